"""A fork that fails half-way leaves the source running and intact and removes every trace of
the partial child: killed at every point of the engine, and on a full disk."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time

import pytest

import bunshin
from bunshin.errors import BunshinError, ForkError
from bunshin.fork import cloners, engine, tree
from bunshin.fork.plan import proc_status
from conftest import leaks, ws_status


def _busy_workspace():
    ws = bunshin.Workspace.create()
    sh = ws.shell()
    sh.run("cd /tmp; V=intact; exec 7>/tmp/log; echo x >&7; sleep 1000 &")
    ws.spawn(["sh", "-c", "printf buffered | python3 -c 'import signal; signal.pause()'"])
    ws.spawn(["python3", "-c", "import time\nwhile True: time.sleep(0.05)"])
    time.sleep(0.5)  # printf writes its bytes and exits: let the tree settle
    return ws, sh


def _snapshot_of_state():
    return {k: v for k, v in leaks().items() if k != "inits"}


@pytest.mark.parametrize("where", ["clone", "fixup", "detach-time"])
def test_killed_at_every_point_of_a_fork(no_leaks, monkeypatch, where):
    ws, sh = _busy_workspace()
    try:
        procs = [p.pid for p in ws.processes()]
        before = _snapshot_of_state()
        for k in range(1, len(procs)):  # every non-init process is a kill point
            calls = {"n": 0}
            real_clone, real_fix = cloners.Cloner.clone, engine.fix_process
            real_make = tree.Maker._clone

            def clone(cl, source, proc, child_inits, tmp, *rest):
                cs = real_clone(cl, source, proc, child_inits, tmp, *rest)  # one per child of the call
                calls["n"] += 1
                if where == "clone" and calls["n"] == k:
                    os.kill(cs[-1].pid, 9)  # dies between clone and fixup
                return cs

            def make(maker, child, proc, *rest):  # an exact tree's (fork/tree.py): one clone
                made = real_make(maker, child, proc, *rest)
                calls["n"] += 1
                if where == "clone" and calls["n"] == k:
                    os.kill(made[0].pid, 9)  # dies before its children and fixups
                return made

            def fix(ctx, proc, c):  # the k-th fixup (an exact tree's come after all its clones)
                calls["fixed"] = calls.get("fixed", 0) + 1
                if where == "fixup" and calls["fixed"] == k:
                    os.kill(c.pid, 9)
                real_fix(ctx, proc, c)
                if where == "detach-time" and calls["fixed"] == k:
                    os.kill(ctx.init_hostpid, 9)  # the child's init dies before the child is whole
                    raise ForkError("child init died")

            monkeypatch.setattr(cloners.Cloner, "clone", clone)
            monkeypatch.setattr(tree.Maker, "_clone", make)
            monkeypatch.setattr(engine, "fix_process", fix)
            with pytest.raises(BunshinError):
                ws.fork(1)
            monkeypatch.setattr(cloners.Cloner, "clone", real_clone)
            monkeypatch.setattr(tree.Maker, "_clone", real_make)
            monkeypatch.setattr(engine, "fix_process", real_fix)
            # the source is intact and running; the dead child's init is reaped by the
            # source's init (its parent) as soon as it runs again
            deadline = time.monotonic() + 5
            while [p.pid for p in ws.processes()] != procs and time.monotonic() < deadline:
                time.sleep(0.02)
            assert [p.pid for p in ws.processes()] == procs
            assert sh.run("echo $V $PWD").stdout == b"intact /tmp\n"
            assert not ws.cgroup.frozen()
            assert _snapshot_of_state() == before
        (kid,) = ws.fork(1)  # and it still forks
        assert kid.shells[0].run("echo $V").stdout == b"intact\n"
        kid.close()
    finally:
        ws.close()


def test_full_disk_fails_cleanly(no_leaks, monkeypatch):
    tiny = tempfile.mkdtemp(prefix="bunshin-full-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,nr_inodes=400", "tmpfs", tiny], check=True)
    try:
        monkeypatch.setenv("BUNSHIN_STATE_DIR", tiny)
        ws = bunshin.Workspace.create()
        try:
            sh = ws.shell()
            sh.run("V=kept")
            # use up the inodes of the state file system from inside the workspace
            ws.run("mkdir -p /fill && cd /fill && for i in $(seq 1000); do : > f$i || break; done")
            with pytest.raises(ForkError):
                ws.fork(1)
            assert sh.run("echo $V").stdout == b"kept\n"
            assert sorted(os.listdir(os.path.join(tiny, "ws"))) == [ws.id]
        finally:
            ws.close()
    finally:
        subprocess.run(["umount", tiny], check=True)
        os.rmdir(tiny)
        with contextlib.suppress(FileNotFoundError):  # the state lock the library made beside it
            os.unlink(tiny + ".lock")


# Holds a PTRACE_SEIZE on a process (as a debugger would) until its stdin closes.
_OTHER_TRACER = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
if libc.ptrace(0x4206, int(sys.argv[1]), None, None):  # PTRACE_SEIZE
    sys.exit(f"seize: errno {ctypes.get_errno()}")
print("seized", flush=True)
sys.stdin.read()
"""


def test_process_traced_by_someone_else_fails_cleanly(no_leaks):
    """The engine seizes init first, then fails on a process a debugger holds: the init it
    already seized (frozen, not yet stopped) is let go as well, and the source runs on."""
    ws, sh = _busy_workspace()
    try:
        procs = [p.pid for p in ws.processes()]
        hostpid = next(hp for hp in ws.host_pids()
                       if b"time.sleep(0.05)" in open(f"/proc/{hp}/cmdline", "rb").read())
        other = subprocess.Popen([sys.executable, "-c", _OTHER_TRACER, str(hostpid)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert other.stdout.readline() == "seized\n"
            with pytest.raises(ForkError, match=r"\(python3\) is traced by host process"):
                ws.fork(1)
            assert [p.pid for p in ws.processes()] == procs
            assert sh.run("echo $V $PWD").stdout == b"intact /tmp\n"
            assert not ws.cgroup.frozen()
        finally:
            other.stdin.close()
            other.wait()
        (kid,) = ws.fork(1)  # once the debugger is gone it forks
        assert kid.shells[0].run("echo $V").stdout == b"intact\n"
        kid.close()
    finally:
        ws.close()


def test_fork_at_the_pids_limit_says_so_and_the_source_runs_on(no_leaks):
    """A fork's child init (and each intermediate) is born in the source's cgroup: at its pids
    limit clone3 gets EAGAIN, which the error turns into what to change; nothing is left."""
    ws = bunshin.Workspace.create(pids_limit=3)
    try:
        sh = ws.shell()  # init + bash + the sleep: the limit
        sh.run("V=intact; sleep 1000 &")
        procs = [p.pid for p in ws.processes()]
        assert ws.cgroup.stats().pids_current == 3
        with pytest.raises(ForkError, match=r"at its pids limit \(3 of 3 processes and threads\).*"
                                            r"pids_limit of at least 5") as e:
            ws.fork(1)
        assert e.value.errno == 11 and "EAGAIN" not in str(e.value)
        assert [p.pid for p in ws.processes()] == procs
        assert sh.run("echo $V").stdout == b"intact\n"  # a builtin: no pid needed
        assert not ws.cgroup.frozen()
    finally:
        ws.close()


def test_a_child_that_cannot_get_its_pid_fails_cleanly(no_leaks, monkeypatch):
    """The pid a process must have in the child is taken there: the intermediate its clone
    goes through is made to take it, so clone3's set_tid finds it in use (EEXIST). The clones
    made before it go with the partial child, the error names the process, the source runs
    on, and it forks once the pid is free."""
    if not cloners.cloner().through_intermediates:
        pytest.skip("the module clones without intermediates")
    ws, sh = _busy_workspace()
    try:
        procs = [p.pid for p in ws.processes()]
        before = _snapshot_of_state()
        victim = next(hp for hp in ws.host_pids()
                      if b"time.sleep(0.05)" in open(f"/proc/{hp}/cmdline", "rb").read())
        vpid = int(proc_status(victim)["NSpid"].split()[-1])  # its pid in the workspace
        real = engine.make_mid

        def make_mid(tp, child_init, tmp_pid, sibling=False):
            return real(tp, child_init, vpid if tp.pid == victim else tmp_pid, sibling)

        monkeypatch.setattr(engine, "make_mid", make_mid)
        with pytest.raises(ForkError, match=rf"process {vpid} \(python3\).*[Ff]ile exists") as e:
            ws.fork(1)
        assert e.value.errno == 17
        assert [p.pid for p in ws.processes()] == procs
        assert sh.run("echo $V $PWD").stdout == b"intact /tmp\n"
        assert not ws.cgroup.frozen()
        assert _snapshot_of_state() == before
        monkeypatch.setattr(engine, "make_mid", real)
        (kid,) = ws.fork(1)
        try:  # (the sh of the pipeline may be gone in it: its wait4 finds no child there)
            assert vpid in [p.pid for p in kid.processes()]
            assert kid.shells[0].run("echo $V").stdout == b"intact\n"
        finally:
            kid.close()
    finally:
        ws.close()


@pytest.mark.parametrize("how", ["another user", "a bounding set without CAP_SYS_ADMIN"])
def test_a_process_that_cannot_clone_itself_is_forked_with_its_ids_and_capabilities(no_leaks, how):
    """A process that switched to another user, or runs as root without CAP_SYS_ADMIN, could
    not enter the child's namespaces nor take its pid there by itself: on a stock kernel the
    child's init makes it there (a transplant, fork/transplant.py), with the module's FORK the
    kernel does; either way it has its ids and capabilities, and the source runs on."""
    ws, sh = _busy_workspace()
    try:
        if how == "another user":
            argv = ["python3", "-c", "import os, time\nos.setgroups([]); os.setresgid(1001, 1001, 1001)\n"
                    "os.setresuid(1000, 1000, 1000)\nwhile True: time.sleep(0.05)"]
        else:
            argv = ["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin", "sleep", "1000"]
        pid = ws.spawn(argv)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not _lacks_sys_admin(ws, pid):
            time.sleep(0.02)
        procs = [p.pid for p in ws.processes()]
        (kid,) = ws.fork(1)
        try:
            assert kid.shells[0].run("echo $V").stdout == b"intact\n"
            for key in ("Uid", "Gid", "Groups", "CapEff", "CapPrm", "CapBnd"):
                assert _status(kid, pid, key) == _status(ws, pid, key), key
            # asleep in both once back in their sleep (a slow guest shows either running for a
            # moment after the fork lets them go)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not all(
                    _status(w, pid, "State").startswith("S") for w in (kid, ws)):
                time.sleep(0.02)
            assert [_status(w, pid, "State") for w in (kid, ws)] == ["S (sleeping)"] * 2
        finally:
            kid.close()
        assert [p.pid for p in ws.processes()] == procs
        assert sh.run("echo $V $PWD").stdout == b"intact /tmp\n"
        assert not ws.cgroup.frozen()
    finally:
        ws.close()


def _status(ws, pid: int, key: str) -> str:
    for line in ws.read_file(f"/proc/{pid}/status").decode().splitlines():
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
    return ""


def _lacks_sys_admin(ws, pid: int) -> bool:
    try:
        return not int(ws_status(ws, pid, "CapEff"), 16) >> 21 & 1
    except BunshinError:
        return False


def test_a_child_whose_workspace_cannot_be_built_is_removed(no_leaks, monkeypatch):
    """The last step of a fork hands the child's body to a new Workspace; if that fails, the
    body's parts (init, cgroup, directory, root, terminals) go with the rest of the child."""
    ws, sh = _busy_workspace()
    try:
        before = _snapshot_of_state()

        def refuse(*_a, **_k):
            raise BunshinError("no workspace for this body")

        monkeypatch.setattr(bunshin.Workspace, "from_body", refuse)
        with pytest.raises(BunshinError, match="no workspace for this body"):
            ws.fork(1)
        monkeypatch.undo()
        assert sh.run("echo $V $PWD").stdout == b"intact /tmp\n"
        deadline = time.monotonic() + 5
        while _snapshot_of_state() != before and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _snapshot_of_state() == before
        (kid,) = ws.fork(1)
        assert kid.shells[0].run("echo $V").stdout == b"intact\n"
        kid.close()
    finally:
        ws.close()
