"""The fork engine's thread (bunshin/fork/keeper.py): a template forked with ``tpl.fork()``
stays seized by it, frozen, between forks, and is let go when its handle closes; children's
inits are cloned ahead into the template's slots (bunshin/fork/earlyinit.py)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import bunshin
from bunshin.fork import keeper
from bunshin.fork.plan import proc_status
from bunshin.runtime.cgroup._fs import wait_for


def _tracer(pid: int) -> int:
    return int(proc_status(pid)["TracerPid"])


def _engine_tid() -> int:
    t = next(t for t in threading.enumerate() if t.name == "bunshin-fork")
    assert t.native_id is not None
    return t.native_id


def _wait_early(core, n: int, timeout: float = 10.0) -> list:
    """The template's slots once ``n`` of them have a settled init made ahead."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with core.lock:
            ready = [s for s in core.slots if s.early is not None and s.early.chan.ready]
        if len(ready) >= n:
            return ready
        time.sleep(0.01)
    raise AssertionError(f"{len(ready)} slots with an init made ahead, wanted {n}")


def test_template_is_held_between_forks_and_let_go_on_close(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    sh = ws.shell()
    sh.run("V=kept; cd /tmp")
    tpl = ws.snapshot()
    core = tpl._core
    try:
        family += tpl.fork(1)
        me = set(int(t) for t in os.listdir("/proc/self/task"))
        engine_tid = _engine_tid()
        assert engine_tid in me
        for pid in tpl.host_pids():
            assert _tracer(pid) == engine_tid, pid  # seized by the engine's thread, not us
        assert wait_for(core.body.cgroup.frozen, 5)  # frozen, as without it (once idle)
        family += tpl.fork(2)
        for k in family[1:]:
            assert k.shells[0].run("echo $V $PWD").stdout == b"kept /tmp\n"
        mids = [mid.pid for s in _wait_settled(core, 2) for mid in s.early.mids.values()]
        core.let_go()  # as after a failure: the next fork seizes again
        assert [_tracer(pid) for pid in tpl.host_pids()] == [0, 0]
        assert not any(os.path.exists(f"/proc/{pid}") for pid in mids)  # made ahead: reaped
        assert all(not s.early.mids for s in core.slots if s.early is not None)
        family += tpl.fork(1)
        assert family[-1].shells[0].run("echo $V").stdout == b"kept\n"
        assert _tracer(tpl.host_pids()[0]) == engine_tid
    finally:
        tpl.close()
    # children live on: the template stays, frozen, no longer traced
    assert [_tracer(pid) for pid in tpl.host_pids()] == [0, 0]
    assert core.body.cgroup.frozen()
    assert family[-1].run("echo alive").stdout == b"alive\n"


def test_held_template_forks_past_the_held_signal_limit(ws):
    """Every closed child's init sends SIGCHLD to the held template's init, which compel holds
    back until it lets go; a standard signal already held is not held twice, so a template
    forked and closed more often than compel can hold signals (64) keeps forking."""
    ws.run("sleep 1000 &")
    tpl = ws.snapshot()
    try:
        for i in range(72):
            (kid,) = tpl.fork(1)
            if i % 24 == 0:
                assert kid.run("echo $((6*7))").stdout == b"42\n"
            kid.close()
        (kid,) = tpl.fork(1)
        assert kid.run("echo last").stdout == b"last\n"
        kid.close()
    finally:
        tpl.close()
    assert ws.run("echo source").stdout == b"source\n"


def _wait_settled(core, n: int) -> list:
    """As _wait_early, once their shells' pty masters are open and meta files written too."""
    deadline = time.monotonic() + 10
    while True:
        ready = _wait_early(core, n)
        if all(s.early.meta is not None for s in ready):
            return ready
        assert time.monotonic() < deadline, "the inits made ahead never settled"
        time.sleep(0.01)


def test_childrens_inits_are_made_ahead_and_used(family, monkeypatch):
    monkeypatch.setenv("BUNSHIN_FORK_SLOTS", "1")
    ws = bunshin.Workspace.create()
    family.append(ws)
    sh = ws.shell()
    sh.run("W=ahead; stty rows 45 cols 123")
    pty = int(sh.run("tty").stdout.split(b"/")[-1])
    tpl = ws.snapshot()
    try:
        family += tpl.fork(2)
        ready = _wait_settled(tpl._core, 2)
        early = {s.early.ci.pid for s in ready}
        for pid in early:  # running, in the slot's own cgroup, moved into its root
            assert os.path.exists(f"/proc/{pid}")
        masters = {s.early.ci.pid: s.early.masters for s in ready}
        assert all(list(m) == [pty] for m in masters.values())  # the shell's, opened ahead too
        # and, without the module, the intermediate each template process's clone goes through
        mids = [mid.pid for s in ready for mid in s.early.mids.values()]
        assert len(mids) == (2 if _user_space() else 0)
        kids = tpl.fork(2)
        family += kids
        assert {k.init_pid for k in kids} == early
        # used, ended, reaped (in the engine's idle time)
        assert wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in mids), 5)
        for k in kids:
            assert k.shells[0].master == masters[k.init_pid][pty]  # the one made ahead
            assert k.shells[0].run("echo $W; stty size").stdout == b"ahead\n45 123\n"
            k.write_file("/tmp/own", k.id)
        for k, other in zip(kids, kids[::-1]):  # each init moved into its own root
            assert k.read_file("/tmp/own") == k.id.encode()
            assert other.run(f"grep -c {k.id} /tmp/own").stdout == b"0\n"
        again = _wait_settled(tpl._core, 2)
        unused = {m: _file_id(m) for s in again for m in s.early.masters.values()}
        mids = [mid.pid for s in again for mid in s.early.mids.values()]
    finally:
        tpl.close()
    for fd, was in unused.items():  # made again for the next call; removed unused by close, masters too
        assert _file_id(fd) != was, fd
    assert not any(os.path.exists(f"/proc/{pid}") for pid in mids)  # and intermediates


def _user_space() -> bool:
    from bunshin.fork import cloners

    return cloners.cloner().through_intermediates


def _file_id(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def test_no_early_inits_when_turned_off(family, monkeypatch):
    monkeypatch.setenv("BUNSHIN_EARLY_INIT", "0")
    ws = bunshin.Workspace.create()
    family.append(ws)
    tpl = ws.snapshot()
    try:
        family += tpl.fork(1)
        deadline = time.monotonic() + 10
        while not tpl._core.slots and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert tpl._core.slots and all(s.early is None for s in tpl._core.slots)
        family += tpl.fork(1)
        assert family[-1].run("echo ok").stdout == b"ok\n"
    finally:
        tpl.close()


def test_a_caller_that_stops_waiting_leaves_the_result_to_abandon():
    """A KeyboardInterrupt while a fork runs in the engine's thread: the fork finishes there
    and what it made is handed to ``abandon`` (closed), not lost."""
    got: list = []
    started = threading.Event()

    def slow() -> str:
        started.set()
        time.sleep(0.3)
        return "made"

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(KeyboardInterrupt):
            keeper.fork_thread().run(slow, abandon=got.append)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert started.is_set()
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == ["made"]
    assert keeper.fork_thread().run(lambda: "next") == "next"  # the engine goes on


def test_an_interruption_just_after_the_call_finished_still_disposes_of_its_result(monkeypatch):
    """The interruption can land after the call finished but before the caller took the
    result: what the call made is still handed to ``abandon``, at once; a call's own failure
    is not (it made nothing to dispose of)."""
    real = keeper._Call.wait

    def late(self):
        real(self)  # the call has finished
        raise KeyboardInterrupt

    got: list = []
    monkeypatch.setattr(keeper._Call, "wait", late)
    with pytest.raises(KeyboardInterrupt):
        keeper.fork_thread().run(lambda: "made", abandon=got.append)
    assert got == ["made"]
    with pytest.raises(KeyboardInterrupt):
        keeper.fork_thread().run(lambda: 1 / 0, abandon=got.append)  # its own failure, then the interruption
    assert got == ["made"]
    monkeypatch.setattr(keeper._Call, "wait", real)

    def fails():
        raise ValueError("its own failure")

    with pytest.raises(ValueError):
        keeper.fork_thread().run(fails, abandon=got.append)
    assert got == ["made"]


def test_engine_runs_calls_made_from_its_own_thread_at_once():
    e = keeper.fork_thread()
    assert e.run(lambda: e.run(lambda: threading.current_thread().name)) == "bunshin-fork"


def test_a_failed_fork_of_a_held_template_lets_go_and_the_next_one_seizes_again(family, monkeypatch):
    from bunshin.errors import ForkError
    from bunshin.fork import engine

    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.shell().run("V=again")
    tpl = ws.snapshot()
    try:
        family += tpl.fork(1)
        assert _tracer(tpl.host_pids()[0]) == _engine_tid()
        real = engine.fix_process

        def broken(ctx, proc, c):
            raise ForkError("injected failure")

        monkeypatch.setattr(engine, "fix_process", broken)
        taken = {m: _file_id(m) for s in _wait_settled(tpl._core, 1) for m in s.early.masters.values()}
        assert taken
        with pytest.raises(ForkError, match="injected failure"):
            tpl.fork(2)  # one child from the slot made ahead, one made by the fork
        monkeypatch.setattr(engine, "fix_process", real)
        assert all(_file_id(fd) != was for fd, was in taken.items())  # its pty master closed
        assert [_tracer(pid) for pid in tpl.host_pids()] == [0, 0]  # let go, still frozen
        assert tpl._core.body.cgroup.frozen()
        family += tpl.fork(1)
        assert family[-1].shells[0].run("echo $V").stdout == b"again\n"
    finally:
        tpl.close()


def test_a_held_template_process_killed_fails_the_next_fork_cleanly(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.spawn(["sleep", "1000"])
    tpl = ws.snapshot()
    try:
        family += tpl.fork(1)
        sleeper = tpl.host_pids()[-1]
        os.kill(sleeper, signal.SIGKILL)
        with pytest.raises(bunshin.BunshinError):
            tpl.fork(1)
        assert family[-1].run("echo child").stdout == b"child\n"  # earlier children live on
    finally:
        tpl.close()
    assert ws.run("echo source").stdout == b"source\n"


def test_each_child_talks_to_its_own_init(family):
    """Every init cloned from the template can read the template's control socket until its
    start-up message moves it to its own: a clone is made only once the previous message was
    taken, so no init takes another's root and channel (tpl.fork(8) and the inits made ahead
    clone several in a row)."""
    ws = bunshin.Workspace.create()
    family.append(ws)
    tpl = ws.snapshot()
    try:
        for _ in range(3):
            kids = tpl.fork(8)
            family += kids
            for k in kids:
                inside = k.run("readlink /proc/self/ns/pid").stdout.decode().strip()
                assert inside == os.readlink(f"/proc/{k.init_pid}/ns/pid"), k
            for k in kids:
                family.remove(k)
                k.close()
            time.sleep(0.1)  # the next call's inits are made ahead meanwhile
    finally:
        tpl.close()


def test_no_clone_while_a_start_up_message_waits():
    import socket

    from bunshin.errors import ForkError
    from bunshin.fork import engine

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        engine._wait_taken(ours, timeout=0.1)  # nothing sent: at once
        socket.send_fds(ours, [b"reroot"], [0])
        with pytest.raises(ForkError, match="did not take its start-up message"):
            engine._wait_taken(ours, timeout=0.1)
        socket.recv_fds(theirs, 64, 4)
        engine._wait_taken(ours, timeout=0.1)


def test_a_child_shows_no_intermediate_when_its_fork_returns(family):
    """The intermediates a fork clones through (made ahead or not) live in the child's pid
    namespace; their zombies are reaped before the fork returns, so the child's first look at
    its processes (``ps``, an agent's first tool call) sees the template's and no other."""
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.run("sleep 1000 & sleep 1000 &")
    want = [(p.pid, p.cmdline) for p in ws.processes()]
    tpl = ws.snapshot()
    try:
        for i in range(4):
            if i and _user_space():
                (s,) = _wait_settled(tpl._core, 1)
                assert len(s.early.mids) == 2  # this fork clones through intermediates made ahead
            kids = tpl.fork(1)
            family += kids
            got = [(p.pid, p.cmdline, p.state) for p in kids[0].processes()]
            assert [(pid, cmd) for pid, cmd, _ in got] == want and "Z" not in {st for *_, st in got}
    finally:
        tpl.close()


def test_intermediates_made_ahead_are_in_their_childs_cgroup_and_so_are_its_clones(family):
    """An intermediate made ahead goes into its child's cgroup: the clone made from it is born
    there (the fork does not move it), and the template's pids limit does not count them. A
    child whose limit could not hold them beside its clones gets none (its fork makes its own,
    in the template, one at a time); the template stays held either way."""
    tasks, mids_each = 4, 3  # init and three sleeps
    for limit in (tasks + mids_each, tasks + mids_each - 1):
        ahead = _user_space() and limit >= tasks + mids_each
        ws = bunshin.Workspace.create(pids_limit=limit)
        family.append(ws)
        ws.run("sleep 1000 & sleep 1000 & sleep 1000 &")
        tpl = ws.snapshot()
        core = tpl._core
        try:
            tcg = core.body.cgroup  # the template's (ws goes on as a fork of it)
            family += tpl.fork(1)
            engine_tid = _engine_tid()
            (s,) = _wait_settled(core, 1)
            mids = [m.pid for m in s.early.mids.values()]
            assert len(mids) == (mids_each if ahead else 0), limit
            assert set(mids) <= set(s.cg.pids())
            assert tcg.stats().pids_current == tasks
            moved: list[int] = []
            real_add = type(s.cg).add
            try:
                type(s.cg).add = lambda cg, pid: (moved.append(pid), real_add(cg, pid))[1]
                (kid,) = kids = tpl.fork(1)
            finally:
                type(s.cg).add = real_add
            family += kids
            if ahead:
                assert moved == []  # no clone moved: each was born in the child's cgroup
            # the intermediates' zombies are gone when the fork returns: they would take the
            # pids the child's programs need (the tool call below could not start)
            assert kid.cgroup.stats().pids_current == tasks
            assert kid.run("pgrep -c sleep").stdout == b"3\n"
            assert [_tracer(pid) for pid in tpl.host_pids()] == [engine_tid] * tasks
        finally:
            tpl.close()
