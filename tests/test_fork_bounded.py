"""Every wait of a fork on the kernel is bounded: a process that does not reach the stop the
fork waits for fails it with a ForkError naming the process and the stop, the source thawed,
intact and running, nothing left attached and nothing left behind. Each case provokes the
wait for real (a vfork parent in uninterruptible sleep, a thread that never gets the signal it
should stop for, attaches that add up; in compel: a thread asleep in its vfork while stop_all
waits, an injected call that blocks) with its bound made small."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from conftest import SCRIPT_PRELUDE, build_vforker, leaks, start_script, wait_file

import bunshin
from bunshin.errors import ForkError
from bunshin.fork import plan, seize
from bunshin.fork.plan import proc_status
from bunshin.fork.resources import signals

pytestmark = pytest.mark.timeout(60)


def host_pid(w, pid: int) -> int:
    return next(hp for hp in w.host_pids() if proc_status(hp)["NSpid"].split()[-1] == str(pid))


def assert_let_go(w, timeout: float = 10) -> None:
    """Every process of ``w`` untraced and not in a ptrace or signal stop (within ``timeout``:
    a straggler is let go once it reaches the stop it was asked for)."""
    deadline = time.monotonic() + timeout
    while True:
        held = {}
        for hp in w.host_pids():
            try:
                st = proc_status(hp)
            except FileNotFoundError:  # exited meanwhile
                continue
            if st["TracerPid"] != "0" or st["State"][0] in "tT":
                held[hp] = (st["Name"], st["TracerPid"], st["State"])
        if not held:
            return
        assert time.monotonic() < deadline, f"still held: {held}"
        time.sleep(0.02)


def leaks_but_inits() -> dict:
    return {k: v for k, v in leaks().items() if k != "inits"}


def test_a_vfork_parent_that_never_stops_fails_the_fork_and_is_let_go_once_it_wakes(family,
                                                                                     monkeypatch):
    """A vfork parent sleeps uninterruptibly until its child execs, and the seized child stops
    before it can: the parent's stop never comes. (The snapshot would wait for the exec and
    refuse: here it is told there is no vfork, so the seize meets it.)"""
    ws = bunshin.Workspace.create()
    family.append(ws)
    parent = ws.spawn([build_vforker(ws), "4000"])
    wait_file(ws, "/tmp/vforking")
    time.sleep(0.1)
    assert proc_status(host_pid(ws, parent))["State"][0] == "D"
    before = leaks_but_inits()
    monkeypatch.setattr(plan, "vfork_pairs", lambda procs: [])
    monkeypatch.setattr(seize, "STOP_TIMEOUT", 0.5)
    t0 = time.monotonic()
    with pytest.raises(ForkError, match=rf"process {parent} \(v\) did not reach a ptrace stop "
                                        r"within 0.5 s") as e:
        ws.fork(1)
    assert e.value.step == "wait"
    assert time.monotonic() - t0 < 10
    # still asleep, still attached: a second fork refuses it at once, naming it
    with pytest.raises(ForkError, match=rf"process {parent} \(v\) has not reached the ptrace "
                                        "stop an earlier fork asked for"):
        ws.fork(1)
    monkeypatch.undo()
    assert ws.run("echo ok").stdout == b"ok\n"  # thawed: it takes tool calls meanwhile
    child = int(wait_file(ws, "/tmp/resumed", 15))  # the child exec'd and the parent went on
    assert ws.run(f"cat /proc/{child}/comm").stdout == b"sleep\n"
    assert_let_go(ws)
    assert leaks_but_inits() == before
    (kid,) = ws.fork(1)  # let go, it forks
    family.append(kid)
    assert int(kid.read_file("/tmp/resumed")) == child
    assert kid.run(f"cat /proc/{parent}/comm").stdout == b"v\n"


# A second thread with SIGUSR2 pending on its own queue (blocked there); on each SIGUSR1 the
# main thread writes /sigpnd: how many it had, and that thread's pending signals as the kernel
# shows them.
PENDING = SCRIPT_PRELUDE + """
import signal, threading
held = threading.Event()
def worker():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    held.set()
    threading.Event().wait()
t = threading.Thread(target=worker)
t.start()
held.wait()
signal.pthread_kill(t.ident, signal.SIGUSR2)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
out('/ready', f'{os.getpid()} {t.native_id}')
n = 0
while True:
    signal.sigwait({signal.SIGUSR1})
    n += 1
    pnd = [l for l in open(f'/proc/self/task/{t.native_id}/status') if l.startswith('SigPnd')]
    out('/sigpnd', f'{n} {pnd[0].split()[1]}')
"""


class _NoTrigger:
    """signals.py's libc, but the tgkill that should stop the thread is not sent: the thread,
    let go, runs on (asleep in its wait) and never stops."""

    def __init__(self, libc) -> None:
        self._libc = libc

    def __getattr__(self, name: str):
        return getattr(self._libc, name)

    def syscall(self, nr: int, *args):
        return 0 if nr == 234 else self._libc.syscall(nr, *args)  # tgkill


def sigpnd(w, pid: int, timeout: float = 15) -> str:
    """The pending signals of the victim's thread, as it reports them (read from the host: no
    tool call, which a source whose fork failed after its first seize cannot take; see
    seize.ignore_children)."""
    def report() -> tuple[int, str]:
        try:
            n, mask = w.read_file("/sigpnd").split()
        except bunshin.BunshinError:
            return 0, ""
        return int(n), mask.decode()

    seen = report()[0]
    w.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while (now := report())[0] == seen:
        assert time.monotonic() < deadline, "the victim did not report"
        time.sleep(0.02)
    return now[1]


def test_a_thread_that_never_stops_for_its_signal_fails_the_fork(family, monkeypatch):
    ws = start_script(family, PENDING, "/ready")
    pid, tid = map(int, ws.read_file("/ready").split())
    usr2 = f"{1 << (signal.SIGUSR2 - 1):016x}"
    assert sigpnd(ws, pid) == usr2
    before = leaks_but_inits()
    monkeypatch.setattr(signals, "_libc", _NoTrigger(signals._libc))
    monkeypatch.setattr(signals, "EXPECT_TIMEOUT", 0.5)
    with pytest.raises(ForkError, match=rf"process {pid} \(python3\), thread {tid} of its clone: "
                                        r"did not stop for signal \d+ within 0.5 s") as e:
        ws.fork(1)
    assert e.value.step == "signals"
    monkeypatch.undo()
    assert_let_go(ws)
    assert leaks_but_inits() == before
    assert sigpnd(ws, pid) == usr2  # the source's thread still has its signal
    (kid,) = ws.fork(1)
    family.append(kid)
    for w in (ws, kid):
        assert sigpnd(w, pid) == usr2


def test_attaches_that_add_up_past_the_bound_are_each_within_it(family, monkeypatch):
    """Where wchan tells nothing each frozen process's attach is watched: by its own timer,
    so attaches that take longer than STOP_TIMEOUT together, each well within it, fork."""
    ws = bunshin.Workspace.create()
    family.append(ws)
    pids = [ws.spawn(["sleep", "1000"]) for _ in range(5)]
    monkeypatch.setattr(seize, "in_group_stop", lambda pid: None)
    monkeypatch.setattr(seize, "STOP_TIMEOUT", 0.5)
    real = seize._seize_watched

    def slow(cg, pl, tracees):
        time.sleep(0.15)  # between attaches: not the attach's own time
        real(cg, pl, tracees)

    monkeypatch.setattr(seize, "_seize_watched", slow)
    (kid,) = ws.fork(1)
    family.append(kid)
    monkeypatch.undo()
    for p in pids:
        assert kid.run(f"cat /proc/{p}/comm").stdout == b"sleep\n"
    assert_let_go(ws)


def test_a_stopped_process_whose_attach_waits_for_the_thaw_is_named_and_left_stopped(family,
                                                                                  monkeypatch):
    """Where wchan tells nothing, the attach to a process stopped by a signal waits for a thaw
    (uninterruptibly): the attempt's timer thaws, the fork fails naming it, and it is left
    in its own stop, untraced, the others running."""
    ws = bunshin.Workspace.create()
    family.append(ws)
    other = ws.spawn(["sleep", "1000"])
    stopped = ws.spawn(["sleep", "1001"])
    ws.kill(stopped, signal.SIGSTOP)
    hp = host_pid(ws, stopped)
    deadline = time.monotonic() + 5
    while proc_status(hp)["State"][0] != "T" and time.monotonic() < deadline:
        time.sleep(0.01)
    before = leaks_but_inits()
    monkeypatch.setattr(seize, "in_group_stop", lambda pid: None)
    monkeypatch.setattr(seize, "STOP_TIMEOUT", 0.5)
    t0 = time.monotonic()
    with pytest.raises(ForkError, match=rf"process {stopped} \(sleep\): its ptrace attach did not "
                                        r"return within 0.5 s"):
        ws.fork(1)
    assert time.monotonic() - t0 < 10
    monkeypatch.undo()
    assert leaks_but_inits() == before
    deadline = time.monotonic() + 5  # let go, it goes back into its stop from the kernel
    while proc_status(hp)["State"][0] != "T" and time.monotonic() < deadline:
        time.sleep(0.01)
    for p in ws.host_pids():
        st = proc_status(p)
        assert st["TracerPid"] == "0"
        assert st["State"][0] in ("T" if p == hp else "SR"), (p, st["State"])
    assert ws.run(f"kill -0 {other} && echo alive").stdout == b"alive\n"
    ws.kill(stopped, signal.SIGCONT)
    assert_let_go(ws)


def test_a_watch_that_fires_after_its_attempt_does_nothing(monkeypatch):
    """An attempt's timer firing once the attempt is over neither thaws nor reports."""
    thawed = []

    class Group:
        def thaw(self):
            thawed.append(threading.current_thread().name)

    monkeypatch.setattr(seize, "STOP_TIMEOUT", 0.05)
    w = seize._AttachWatch(Group())
    assert w.cancel() is False
    time.sleep(0.1)
    assert thawed == []
    w = seize._AttachWatch(Group())
    time.sleep(0.2)
    assert w.cancel() is True and len(thawed) == 1


def test_a_request_to_an_init_that_does_not_read_fails_in_bounded_time(no_leaks, monkeypatch):
    """Requests given up on stay queued at a frozen init until its queue is full: the next send
    waits SEND_TIMEOUT_S, not for ever; thawed, the init answers again."""
    from bunshin.errors import ProtocolError
    from bunshin.runtime import channel

    monkeypatch.setattr(channel, "SEND_TIMEOUT_S", 1)
    ws = bunshin.Workspace.create()
    try:
        chan = ws.live_channel()
        ws.cgroup.freeze()
        try:
            t0 = time.monotonic()
            with pytest.raises(ProtocolError, match=r"did not take request \d+ within 1s"):
                for _ in range(1000):
                    try:
                        chan.ping(timeout=0.01)
                    except ProtocolError as e:
                        if "did not answer" not in str(e):
                            raise
            assert time.monotonic() - t0 < 30
        finally:
            ws.cgroup.thaw()
        assert ws.run("echo ok").stdout == b"ok\n"
    finally:
        ws.close()


def fork_via(ws, how: str):
    """One child of ``ws``: by ws.fork(), or by a snapshot's fork (the template closed)."""
    if how == "fork":
        (kid,) = ws.fork(1)
        return kid
    tpl = ws.snapshot()
    try:
        (kid,) = tpl.fork(1)
    finally:
        tpl.close()
    return kid


@pytest.mark.parametrize("how", ["fork", "snapshot"])
def test_a_thread_that_never_stops_fails_stop_all_and_is_let_go_once_it_wakes(family,
                                                                               monkeypatch, how):
    """compel's stop_all waits for every thread's stop: a thread asleep uninterruptibly in its
    vfork never reaches it. The fork fails within the bound naming process and thread, the
    process is let go but for that thread, which is let go once it wakes."""
    ws = bunshin.Workspace.create()
    family.append(ws)
    parent = ws.spawn([build_vforker(ws), "4000", "thread"])
    tid = int(wait_file(ws, "/tmp/vforking"))
    time.sleep(0.1)
    hp = host_pid(ws, parent)
    host_tid = next(int(t) for t in __import__("os").listdir(f"/proc/{hp}/task")
                    if proc_status(f"{hp}/task/{t}")["NSpid"].split()[-1] == str(tid))
    assert proc_status(host_tid)["State"][0] == "D"
    before = leaks_but_inits()
    monkeypatch.setattr(plan, "vfork_pairs", lambda procs: [])
    monkeypatch.setattr(seize, "STOP_TIMEOUT", 0.5)
    t0 = time.monotonic()
    with pytest.raises(ForkError, match=rf"process {parent} \(v\): thread {tid} did not reach a "
                                        r"ptrace stop within 0.5 s") as e:
        fork_via(ws, how)
    assert e.value.step == "stop_all"
    assert time.monotonic() - t0 < 10
    # the main thread is let go; the sleeping one stays attached until it stops
    assert proc_status(hp)["TracerPid"] == "0"
    assert proc_status(host_tid)["TracerPid"] != "0"
    with pytest.raises(ForkError, match=rf"process {parent} \(v\) has not reached the ptrace "
                                        "stop an earlier fork asked for"):
        fork_via(ws, how)
    monkeypatch.undo()
    assert ws.run("echo ok").stdout == b"ok\n"
    child = int(wait_file(ws, "/tmp/resumed", 15))  # the child exec'd, the thread went on
    assert ws.run(f"cat /proc/{child}/comm").stdout == b"sleep\n"
    assert_let_go(ws)
    assert leaks_but_inits() == before
    kid = fork_via(ws, how)
    family.append(kid)
    assert int(kid.read_file("/tmp/resumed")) == child
    assert kid.run(f"ls /proc/{parent}/task | wc -l").stdout == b"2\n"


# An empty pipe kept open at both ends; on each SIGUSR1 one byte goes through it and /check
# says what came back: an injected read that took a byte would show.
PIPE_HOLDER = SCRIPT_PRELUDE + """
import signal
r, w = os.pipe()
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
out('/ready', f'{os.getpid()} {r}')
n = 0
while True:
    signal.sigwait({signal.SIGUSR1})
    n += 1
    os.write(w, b'x')
    out('/check', f'{n} {os.read(r, 10).decode()}')
"""


def check(w, pid: int, n: int) -> str:
    w.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 15
    while True:
        try:
            got = w.read_file("/check").decode().split()
        except bunshin.BunshinError:
            got = ["0"]
        if int(got[0]) == n:
            return got[1]
        assert time.monotonic() < deadline, "the victim did not report"
        time.sleep(0.02)


@pytest.mark.parametrize("how", ["syscall", "calls", "remote"])
def test_an_injected_call_that_blocks_fails_within_the_bound_and_is_cured(family, how):
    """A read injected on an empty pipe never returns: past the bound compel interrupts it,
    the thread is put back by cure, the process runs on with its pipe as it was and forks."""
    from bunshin.compel import Tracee
    from bunshin.fork.remote import Remote

    ws = start_script(family, PIPE_HOLDER, "/ready")
    pid, rfd = map(int, ws.read_file("/ready").split())
    hp = host_pid(ws, pid)
    before = leaks_but_inits()
    t = Tracee.seize(hp)
    try:
        t.set_wait_timeout(0.3)
        buf = t.mmap(4096)
        t0 = time.monotonic()
        if how == "remote":
            expect = rf"the victim: read\({rfd}, {buf}, 1\) did not return within 0.3 s"
        else:
            expect = (rf"pid {hp}: thread {hp} did not reach a ptrace stop within 0.3 s at step "
                      r"'(syscall|batch)'")
        with pytest.raises(ForkError, match=expect) as e:
            if how == "syscall":
                t.syscall(0, rfd, buf, 1)  # read
            elif how == "calls":
                t.calls([(39, (), 0), (0, (rfd, buf, 1), 0)])  # getpid, read
            else:
                Remote(t, "the victim").call("read", rfd, buf, 1)
        assert time.monotonic() - t0 < 3
        assert e.value.errno == __import__("errno").ETIMEDOUT
        assert t.syscall(39) == pid  # stopped where it was: injects again
        t.munmap(buf, 4096)
    finally:
        t.detach()
    assert t.late == []
    assert proc_status(hp)["TracerPid"] == "0"
    assert check(ws, pid, 1) == "x"
    assert leaks_but_inits() == before
    (kid,) = ws.fork(1)
    family.append(kid)
    for w in (ws, kid):
        assert check(w, pid, 2) == "x"
