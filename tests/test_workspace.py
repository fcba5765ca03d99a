"""The workspace runtime with real processes in real namespaces."""

from __future__ import annotations

import os
import socket
import time

import pytest

import bunshin
from bunshin.errors import (
    LimitError,
    RootfsError,
    SpawnError,
    ToolCallError,
    WorkspaceClosed,
)


def test_run_captures_stdout_stderr_and_exit_code(ws):
    r = ws.run("echo out; echo err >&2; exit 3")
    assert (r.stdout, r.stderr, r.exit_code) == (b"out\n", b"err\n", 3)
    assert not r.timed_out and not r.truncated and r.signal is None
    assert 0 < r.duration < 5


def test_isolation_namespaces(ws):
    host = {ns: os.readlink(f"/proc/self/ns/{ns}") for ns in ("mnt", "pid", "net", "ipc", "uts")}
    for ns, ident in host.items():
        assert os.readlink(f"/proc/{ws.init_pid}/ns/{ns}") != ident, ns
    r = ws.run("echo $$; cat /proc/1/cmdline | tr '\\0' ' '; echo; hostname; ls /sys/class/net")
    pid, init_cmd, hostname, nets = r.stdout.decode().splitlines()[:4]
    assert int(pid) > 1 and init_cmd.startswith("bunshin-init")
    assert hostname.startswith("bunshin-") and nets == "lo"


def test_hostname_and_env_and_workdir(no_leaks):
    with bunshin.Workspace.create(hostname="agent-7", env={"FOO": "bar"}, workdir="/tmp") as w:
        r = w.run("hostname; echo $FOO; pwd")
        assert r.stdout == b"agent-7\nbar\n/tmp\n"
        r = w.run("echo $FOO $BAZ; pwd", env={"BAZ": "q", "FOO": "over"}, cwd="/usr")
        assert r.stdout == b"over q\n/usr\n"


def test_stdin_bytes(ws):
    data = os.urandom(300_000)  # more than a pipe buffer
    r = ws.exec(["sha256sum"], stdin=data)
    import hashlib

    assert r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()


def test_cgroup_membership(ws):
    r = ws.spawn(["sleep", "30"])
    pids = ws.host_pids()
    assert ws.init_pid in pids and len(pids) >= 2
    ws.kill(r, 9)
    assert ws.wait(r, timeout=5) == 137


def test_command_not_found_is_a_result(ws):
    r = ws.run("definitely-not-a-command --x")
    assert r.exit_code == 127 and b"not found" in r.stderr
    r = ws.exec(["definitely-not-a-command"])
    assert r.exit_code == 127 and b"not found" in r.stderr
    with pytest.raises(SpawnError, match="definitely-not-a-command"):
        ws.spawn(["definitely-not-a-command"])
    with pytest.raises(SpawnError, match="chdir"):
        ws.exec(["true"], cwd="/no/such/dir")


def test_timeout_kills_the_whole_group_and_workspace_stays_usable(ws):
    start = time.monotonic()
    r = ws.run("sleep 100 & sleep 100 & echo started; wait", timeout=0.5)
    assert r.timed_out and r.stdout == b"started\n" and r.exit_code == 128 + 9
    assert time.monotonic() - start < 5
    deadline = time.monotonic() + 5
    while len(ws.processes()) > 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [p.pid for p in ws.processes()] == [1]
    assert ws.run("echo alive").stdout == b"alive\n"


def test_background_child_holding_stdout_does_not_block(ws):
    start = time.monotonic()
    r = ws.run("sleep 30 & echo bg")
    assert r.exit_code == 0 and r.stdout == b"bg\n" and not r.timed_out
    assert time.monotonic() - start < 2


def test_output_cap_flags_truncation(ws):
    r = ws.run("head -c 5000000 /dev/zero; echo done >&2", max_output=100_000)
    assert r.truncated and len(r.stdout) == 100_000 and r.stderr == b"done\n"
    assert r.exit_code == 0


def test_spawn_wait_kill_and_log(ws):
    pid = ws.spawn(["sh", "-c", "echo started; exec sleep 60"], log_path="/tmp/bg.log")
    assert pid > 1
    assert ws.wait(pid, timeout=0.2) is None
    deadline = time.monotonic() + 5
    while ws.read_file("/tmp/bg.log") != b"started\n" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ws.read_file("/tmp/bg.log") == b"started\n"
    assert any(p.pid == pid and p.cmdline[:2] == ["sleep", "60"] for p in ws.processes())
    ws.kill(pid)
    assert ws.wait(pid, timeout=5) == 128 + 15


def test_server_inside_workspace(ws):
    pid = ws.spawn(["python3", "-m", "http.server", "8000", "--bind", "127.0.0.1"], cwd="/etc")
    r = ws.run("for i in $(seq 50); do python3 - <<'E' && exit 0; sleep 0.1; done; exit 1\n"
               "import urllib.request\n"
               "print(urllib.request.urlopen('http://127.0.0.1:8000/hostname').read().decode())\n"
               "E", timeout=30)
    assert r.exit_code == 0, r
    ws.kill(pid)


def test_files_roundtrip_and_parents(ws):
    ws.write_file("/work/a/b/c.txt", b"hello\x00world")
    assert ws.read_file("/work/a/b/c.txt") == b"hello\x00world"
    assert ws.run("cat /work/a/b/c.txt").stdout == b"hello\x00world"
    ws.write_file("/work/a/b/c.txt", "replaced")
    assert ws.read_file("/work/a/b/c.txt") == b"replaced"
    assert ws.read_file("/work/a/b/c.txt", max_bytes=3) == b"rep"
    ws.run("echo from-inside > /tmp/in.txt")
    assert ws.read_file("/tmp/in.txt") == b"from-inside\n"


def test_files_never_escape_the_workspace(ws, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("host only")
    ws.run(f"ln -s {secret} /tmp/link; ln -s ../../../../../../{secret} /tmp/rel")
    for p in ("/tmp/link", "/tmp/rel", f"/../../../..{secret}"):
        with pytest.raises(ToolCallError, match="no such file"):
            ws.read_file(p)
    ws.write_file("/tmp/link2", b"x")
    assert ws.run(f"test -e {secret}").exit_code == 1


def test_bad_tool_call_arguments(ws):
    for bad in (lambda: ws.run(b"echo"), lambda: ws.run("true", timeout=-1),
                lambda: ws.run("true", timeout="1"), lambda: ws.run("true", env={"A": 1}),
                lambda: ws.run("true", cwd="relative"), lambda: ws.exec([]),
                lambda: ws.exec("echo"), lambda: ws.write_file("rel", b""),
                lambda: ws.run("true", max_output=-5), lambda: ws.kill(1)):
        with pytest.raises(ToolCallError):
            bad()


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"rootfs": "/no/such/rootfs"}, RootfsError, "/no/such/rootfs"),
    ({"memory_limit": -1}, LimitError, "memory_limit"),
    ({"memory_limit": "lots"}, LimitError, "memory_limit"),
    ({"pids_limit": 0}, LimitError, "pids_limit"),
    ({"pids_limit": True}, LimitError, "pids_limit"),
    ({"workdir": "tmp"}, ToolCallError, "workdir"),
    ({"hostname": "bad host!"}, bunshin.BunshinError, "hostname"),
])
def test_bad_create_arguments(no_leaks, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        bunshin.Workspace.create(**kwargs)


def test_unreadable_archive(no_leaks, tmp_path):
    bad = tmp_path / "broken.tar"
    bad.write_bytes(b"this is not a tar archive at all" * 100)
    with pytest.raises(RootfsError, match="broken.tar"):
        bunshin.Workspace.create(rootfs=bad)


def test_closed_workspace_raises(no_leaks):
    w = bunshin.Workspace.create()
    w.close()
    w.close()  # idempotent
    for call in (lambda: w.run("true"), lambda: w.shell(), lambda: w.write_file("/a", b""),
                 lambda: w.read_file("/etc/hostname"), lambda: w.processes(), lambda: w.spawn(["true"])):
        with pytest.raises(WorkspaceClosed):
            call()


def test_close_removes_everything(no_leaks):
    w = bunshin.Workspace.create()
    w.spawn(["sleep", "100"])
    w.run("dd if=/dev/zero of=/big bs=1M count=5 status=none")
    state, hostpids = w.state_path, w.host_pids()
    assert (w.body.dir.upper / "big").stat().st_size == 5 << 20
    w.close()
    assert not state.exists()
    for pid in hostpids:
        assert not os.path.exists(f"/proc/{pid}")


def test_many_workspaces_are_independent(no_leaks):
    ws = [bunshin.Workspace.create() for _ in range(4)]
    try:
        for i, w in enumerate(ws):
            w.write_file("/id", str(i))
        assert [w.run("cat /id").stdout for w in ws] == [b"0", b"1", b"2", b"3"]
    finally:
        for w in ws:
            w.close()


def test_concurrent_calls_from_threads(ws):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as ex:
        rs = list(ex.map(lambda i: ws.run(f"sleep 0.0{i % 5}; echo {i}"), range(40)))
    assert [r.stdout for r in rs] == [f"{i}\n".encode() for i in range(40)]


def test_loopback_only_network(ws):
    # A server on the host's loopback must not be reachable from the workspace's loopback.
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    try:
        r = ws.run(f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)\"")
        assert r.exit_code != 0 and b"ConnectionRefusedError" in r.stderr
        r = ws.run("cat /proc/net/route | wc -l; ls /sys/class/net")
        assert r.stdout == b"1\nlo\n"  # header line only: no route leaves the workspace
    finally:
        srv.close()
