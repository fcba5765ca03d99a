"""The trainer's limits: it holds thousands of descriptors of its own (every wait of the library
must work on descriptors numbered 1024 and above, which select() cannot watch), its soft limit
is raised, and running out of descriptors or processes is a clear error that leaves the
workspaces already there working."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

import bunshin
from bunshin import kerndat

HELD = 1100


@pytest.fixture
def many_fds():
    """More than 1024 descriptors open, so every one the library opens next is numbered above."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < HELD + 500:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below {HELD + 500}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, HELD + 500), hard))
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(HELD)]
    try:
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_workspaces_fork_and_close_with_descriptors_above_1024(many_fds, tmp_path):
    probe = os.open("/dev/null", os.O_RDONLY)
    os.close(probe)
    assert probe >= 1024  # what the library opens now is out of select()'s reach
    ws = bunshin.Workspace.create()
    try:
        # an inotify watch: forking it drains the copy's own events through a poll
        ws.spawn(["python3", "-c", "import ctypes, os, time\n"
                  "libc = ctypes.CDLL(None); fd = libc.inotify_init1(0)\n"
                  "assert libc.inotify_add_watch(fd, b'/tmp', 0x100) > 0\n"
                  "open('/tmp/ready', 'w').close(); time.sleep(1000)\n"])
        ws.run("while [ ! -e /tmp/ready ]; do sleep 0.02; done", timeout=20)
        kids = ws.fork(2)
        tpl = ws.snapshot()
        kids += tpl.fork(2)
        for kid in kids:
            assert kid.run("echo ok").stdout == b"ok\n"
        for kid in kids:
            kid.close()
        tpl.close()
    finally:
        ws.close()


def test_the_machine_probe_runs_with_descriptors_above_1024(many_fds):
    kd = kerndat.probe()
    assert kd.pidfd_open  # a probe that ran and answered, not one that failed on its pipe


def test_the_trainer_limit_is_raised_and_workspaces_keep_the_machine_s(tmp_path):
    """In a fresh trainer with soft < hard: the first workspace raises the trainer's soft limit
    to the hard one; the workspace's programs still see the soft limit the trainer started with."""
    script = tmp_path / "t.py"
    script.write_text(
        "import resource, bunshin\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (1000, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "with bunshin.Workspace.create() as ws:\n"
        "    print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], ws.run('ulimit -Sn').stdout.decode().strip(),\n"
        "          ws.fork(1)[0].run('ulimit -Sn').stdout.decode().strip())\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert out.stdout.split() == [str(hard), "1000", "1000"]


def test_running_out_of_descriptors_is_a_clear_error_and_the_rest_keeps_working():
    made: list = [bunshin.Workspace.create()]  # the first one raises the soft limit: lower it after
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 150, hard))
    full = r"holds \d+ descriptors of its limit of \d+ \(RLIMIT_NOFILE\)"
    try:
        with pytest.raises(bunshin.OutOfResources, match=full):
            for _ in range(100):
                made += made[-1].fork(1)
        assert len(made) > 5, "hardly a fork fitted in 150 descriptors"
        with pytest.raises(bunshin.OutOfResources, match=full):
            bunshin.Workspace.create()
        for ws in made:
            assert ws.run("echo ok").stdout == b"ok\n"
        for ws in made[len(made) // 2:]:
            ws.close()
        made = made[:len(made) // 2]
        made.append(bunshin.Workspace.create())  # room again
    finally:
        for ws in made:
            ws.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# What a trainer script ends with: asks for one more workspace, then uses its first one.
ANOTHER = """
try:
    bunshin.Workspace.create()
    print("made")
except bunshin.OutOfResources as e:
    print("refused:", e)
print("first:", ws.run("echo ok").stdout.decode().strip())
ws.close()
"""

# Makes a workspace, says its pid, waits to be put in a cgroup with no room for another task,
# then tries a second workspace and uses the first.
NO_PIDS_TRAINER = r"""
import sys, bunshin
ws = bunshin.Workspace.create()
print(flush=True)
sys.stdin.readline()
""" + ANOTHER


def test_running_out_of_processes_is_a_clear_error(tmp_path):
    from bunshin.runtime import cgroup

    if cgroup.backend().name != "v1":
        pytest.skip("the trainer is moved into a cgroup v1 pids group")
    group = f"/sys/fs/cgroup/pids/bunshin-test-nopids-{os.getpid()}"
    script = tmp_path / "t.py"
    script.write_text(NO_PIDS_TRAINER)
    os.mkdir(group)
    p = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        p.stdout.readline()
        with open(f"{group}/cgroup.procs", "w") as f:
            f.write(str(p.pid))
        with open(f"{group}/pids.current") as f:
            used = f.read().strip()
        with open(f"{group}/pids.max", "w") as f:
            f.write(used)  # every thread the trainer has, and not one more
        out, _ = p.communicate("go\n", timeout=60)
        assert p.returncode == 0
        assert f"holds {used} tasks of its pids.max {used}" in out, out
        assert out.startswith("refused: cannot start the workspace init: no process can be made"), out
        assert "first: ok" in out
    finally:
        p.kill()
        p.wait()
        os.rmdir(group)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_thousand_children_answer_and_close_in_a_trainer_holding_many_descriptors(many_fds, no_leaks):
    ws = bunshin.Workspace.create()
    kids: list = []
    try:
        ws.spawn(["python3", "-c", "import time; b = bytearray(16 << 20); time.sleep(10**6)"])
        with ws.snapshot() as tpl:
            while len(kids) < 1000:
                kids += tpl.fork(25)
            assert len({k.id for k in kids}) == 1000
            assert all(k.run(f"echo {i}").stdout == f"{i}\n".encode() for i, k in enumerate(kids))
            while kids:
                kids.pop().close()
    finally:
        for k in kids:
            k.close()
        ws.close()


# Fills its state file system (a small one) from inside a workspace, then asks for another.
FULL_STATE_TRAINER = r"""
import bunshin
ws = bunshin.Workspace.create()
r = ws.run("head -c 300M /dev/zero > /fill; sync", timeout=120)
""" + ANOTHER


def test_a_full_state_file_system_is_a_clear_error(tmp_path, monkeypatch):
    script = tmp_path / "t.py"
    script.write_text(FULL_STATE_TRAINER)
    env = dict(os.environ, BUNSHIN_STATE_DIR=str(tmp_path / "state"), BUNSHIN_STATE_SIZE="384M")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused: the state file system"), out.stdout + out.stderr
    assert "is full (" in out.stdout and "first: ok" in out.stdout, out.stdout
    from bunshin.runtime import statefs

    monkeypatch.setenv("BUNSHIN_STATE_DIR", str(tmp_path / "state"))
    deadline = time.monotonic() + 10  # its workspace was closed; then the state image goes
    while not statefs.release() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.ismount(tmp_path / "state")


def test_a_memory_limit_on_all_workspaces_reached_is_a_clear_error(ws):
    """An administrator's cap on every workspace together (the cgroup prefix's memory limit):
    with less than a workspace's start left, creating or forking says so; the rest runs on."""
    from bunshin.runtime import cgroup

    be = cgroup.backend()
    if be.name != "v1" or "memory" not in be.mounts:
        pytest.skip("the prefix's limit is set through cgroup v1's memory controller")
    top = Path(be.mounts["memory"]) / be.prefix()
    usage = int((top / "memory.usage_in_bytes").read_text())
    (top / "memory.limit_in_bytes").write_text(str(usage + (16 << 20)))
    try:
        full = r"the workspaces' cgroup .* uses \d+ MiB of its memory limit of \d+ MiB"
        with pytest.raises(bunshin.OutOfResources, match=full):
            bunshin.Workspace.create()
        with pytest.raises(bunshin.OutOfResources, match=full):
            ws.fork(1)
        assert ws.run("echo ok").stdout == b"ok\n"
    finally:
        (top / "memory.limit_in_bytes").write_text("-1")
    (kid,) = ws.fork(1)  # room again
    kid.close()
