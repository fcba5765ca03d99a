"""ws.fork() and ws.snapshot() are fork(2) for a workspace: the source runs on as itself (the
same kernel tasks, parents, sessions, children, zombies and descriptors), only the children
are new, and they see the files as they were at the fork while the source writes on."""

from __future__ import annotations

import os
import signal
import time

import pytest

import bunshin


def _task(pid: int) -> tuple:
    """What identifies a task and its place in the tree: start time, state class, parent,
    group, session (host view), and its descriptors."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        st = f.read()
    rest = st[st.rindex(b")") + 2:].split()
    fds = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass
    return int(rest[19]), int(rest[1]), int(rest[2]), int(rest[3]), fds


def _tasks(ws: bunshin.Workspace) -> dict[int, tuple]:
    return {p: _task(p) for p in ws.host_pids()}


def _wait_for(cond, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# A parent that keeps a zombie, a child with PR_SET_PDEATHSIG, and waits for another child
# only when told (SIGUSR1): each checks what a re-cloned source loses.
_PARENT = r"""
import ctypes, os, signal, sys, time
zombie = os.fork()
if zombie == 0:
    os._exit(3)
waited = os.fork()
if waited == 0:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    signal.pause()
    os._exit(0)
def check(*_):
    os.kill(waited, signal.SIGTERM)
    pid, status = os.waitpid(waited, 0)
    zpid, zstatus = os.waitpid(zombie, 0)
    ok = pid == waited and zpid == zombie and os.WEXITSTATUS(zstatus) == 3 and os.getppid() != 1
    open("/tmp/verdict", "w").write("PASS" if ok else f"FAIL {pid} {zpid} {zstatus} {os.getppid()}")
signal.signal(signal.SIGUSR1, check)
open("/tmp/ready", "w").write(f"{waited}")
while True:
    time.sleep(1)
"""


def _start_parent(ws: bunshin.Workspace) -> int:
    sh = ws.shell()
    sh.run("cd /tmp; X=42; sleep 1000 & sleep 1001 &")
    ws.write_file("/tmp/parent.py", _PARENT)
    sh.run("python3 /tmp/parent.py >/dev/null 2>&1 &")
    _wait_for(lambda: ws.run("test -s /tmp/ready").exit_code == 0, "the parent to start")
    _wait_for(lambda: b"Z" in ws.run("ps -o stat= -e").stdout, "the parent's zombie")
    return sh.pid


@pytest.mark.parametrize("how", ["fork", "snapshot"])
def test_the_source_keeps_its_tasks(family, how):
    ws = bunshin.Workspace.create()
    family.append(ws)
    bash = _start_parent(ws)
    before = _tasks(ws)
    made = ws.fork(2) if how == "fork" else [ws.snapshot()]
    family.extend(made)
    assert _tasks(ws) == before  # same tasks, parents, groups, sessions, descriptors
    assert not set(ws.host_pids()) & {p for m in made for p in m.host_pids()}
    # what a clone loses on a stock kernel, the source keeps: its children, zombies, jobs
    assert ws.run("pkill -USR1 -f parent.py").exit_code == 0
    _wait_for(lambda: ws.run("test -s /tmp/verdict").exit_code == 0, "the parent's verdict")
    assert ws.read_file("/tmp/verdict") == b"PASS"
    sh = ws.shells[0]
    assert sh.pid == bash
    r = sh.run("echo $X; kill %1; wait %1; echo rc=$?", timeout=10)
    assert r.stdout.startswith(b"42\n") and r.stdout.endswith(b"rc=143\n"), r.stdout


def test_children_see_the_files_as_at_the_fork(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.write_file("/tmp/a", "at the fork")
    ws.write_file("/tmp/gone", "x")
    kids = ws.fork(2)
    family.extend(kids)
    ws.write_file("/tmp/a", "source after")
    ws.run("rm /tmp/gone; mkdir /tmp/new")
    kids[0].write_file("/tmp/a", "kid 0 after")
    for k, want in zip(kids, (b"kid 0 after", b"at the fork")):
        assert k.read_file("/tmp/a") == want
        assert k.read_file("/tmp/gone") == b"x"
        assert k.run("test -e /tmp/new").exit_code == 1
    assert ws.read_file("/tmp/a") == b"source after"
    assert ws.run("test -e /tmp/gone").exit_code == 1
    # a fork of the source now sees its later writes; a fork of a child, the child's
    (again,) = ws.fork(1)
    family.append(again)
    assert again.read_file("/tmp/a") == b"source after"
    (grandkid,) = kids[0].fork(1)
    family.append(grandkid)
    assert grandkid.read_file("/tmp/a") == b"kid 0 after"
    assert grandkid.read_file("/tmp/gone") == b"x"


def _frozen_layers(ws: bunshin.Workspace) -> list[str]:
    return [p.name for p in ws.body.dir.path.iterdir() if p.name.startswith("frozen-")]


def test_a_source_closed_before_its_children_waits_frozen_for_them(family):
    """The children's pid namespaces are below the source's: its init must outlive them. A
    closed source is frozen (nothing of it runs) and goes with its last child."""
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.shell().run("V=kept")
    kids = ws.fork(2)
    family.extend(kids)
    d, cg, pids = ws.body.dir.path, ws.cgroup, ws.host_pids()
    assert len(_frozen_layers(ws)) == 1
    ws.close()
    assert cg.frozen() and os.path.exists(f"/proc/{pids[0]}")  # its init holds their namespaces
    for k in kids:
        assert k.shells[0].run("echo $V").stdout == b"kept\n"
    kids[0].close()
    assert d.exists() and os.path.exists(f"/proc/{pids[0]}")
    kids[1].close()
    _wait_for(lambda: not any(os.path.exists(f"/proc/{p}") for p in pids), "the source's processes to end")
    assert not d.exists()
    assert cg.name not in bunshin.runtime.cgroup.backend().list()


def test_each_forks_frozen_layer_goes_with_its_last_child(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    first = ws.fork(1)
    second = ws.fork(2)
    family.extend(first + second)
    assert len(_frozen_layers(ws)) == 2
    first[0].close()
    assert len(_frozen_layers(ws)) == 1
    second[0].close()
    assert len(_frozen_layers(ws)) == 1
    second[1].close()
    assert _frozen_layers(ws) == []
    assert ws.run("echo ok").stdout == b"ok\n"


def test_a_forks_processes_are_not_the_sources(family):
    """The source's /proc shows its children's processes (their pid namespaces are below its
    own; on a stock kernel they cannot be elsewhere), but ws.processes() lists its own."""
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.spawn(["sleep", "1000"])
    before = [(p.pid, p.cmdline) for p in ws.processes()]
    kids = ws.fork(1)
    family.extend(kids)
    assert [(p.pid, p.cmdline) for p in ws.processes()] == before
    assert [(p.pid, p.cmdline) for p in kids[0].processes()] == before


def test_a_workspace_with_live_forks_is_not_dumped(family, tmp_path):
    """Its forks' inits are children of its init: CRIU would take them along (and fails on
    them, as they are in cgroups of their own). The dump says so; once they are closed it works."""
    from bunshin import criu
    from bunshin.criu import runner
    from bunshin.errors import CheckpointError, CriuError

    try:
        runner.criu()
    except CriuError as e:
        pytest.skip(f"no usable CRIU: {e}")
    ws = bunshin.Workspace.create()
    family.append(ws)
    (kid,) = ws.fork(1)
    with pytest.raises(CheckpointError, match="has live forks"):
        criu.dump_workspace(ws, tmp_path / "img")
    kid.close()
    criu.dump_workspace(ws, tmp_path / "img")
    assert ws.run("echo on").stdout == b"on\n"


def _host_pid(ws: bunshin.Workspace, pid: int) -> int:
    for host in ws.host_pids():
        with open(f"/proc/{host}/status") as f:
            nspid = next(line.split()[1:] for line in f if line.startswith("NSpid:"))
        if int(nspid[-1]) == pid:
            return host
    raise AssertionError(f"no process {pid} in {ws.id}")


@pytest.mark.parametrize("path", ["ws_fork", "snapshot"])
def test_a_process_killed_as_the_fork_freezes_is_let_exit_first(ws, path):
    """A process the freezer caught with a SIGKILL pending (killed just before the fork) dies
    as soon as it runs: the fork lets the workspace run in short spells until it is gone, and
    forks the rest; the source runs on without it."""
    doomed = ws.spawn(["sleep", "1000"])
    ws.spawn(["sleep", "1001"])
    host = _host_pid(ws, doomed)
    ws.cgroup.freeze()
    os.kill(host, signal.SIGKILL)  # frozen, it cannot take the signal yet
    if path == "ws_fork":
        (kid,) = ws.fork(1)
    else:
        with ws.snapshot() as tpl:
            (kid,) = tpl.fork(1)
    try:
        for w in (kid, ws):
            sleeps = sorted(p.cmdline for p in w.processes() if p.cmdline[:1] == ["sleep"])
            assert sleeps == [["sleep", "1001"]], w.id
            assert w.run("echo ok").stdout == b"ok\n"
    finally:
        kid.close()
