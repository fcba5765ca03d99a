"""Signal and thread state across a fork: every thread's comm, alternate signal stack, rseq
registration and signal mask, pending signals with their siginfo, and a POSIX timer aimed at
one thread (tests/victims/signal_state.c checks them from inside, in the source and in the
child, after ws.fork() and after snapshot() + tpl.fork()); glibc's own rseq registration; a
POSIX timer whose signal is pending at the fork."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

import bunshin
from conftest import fork_one, signal_and_read, start_script, wait_file

SOURCE = (Path(__file__).parent / "victims" / "signal_state.c").read_text()
THREADS = 3


def _start(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.write_file("/s.c", SOURCE)
    built = ws.run("gcc -O1 -pthread -o /s /s.c")
    if not built.ok:
        pytest.skip(f"cannot build the victim: {built.stderr!r}")
    pid = ws.spawn(["env", "GLIBC_TUNABLES=glibc.pthread.rseq=0", "/s"])
    wait_file(ws, "/tmp/ready")
    return ws, pid


def _report(w, pid: int) -> list[str]:
    """Each thread's report, one string (lines in pytest's diffs)."""
    w.kill(pid, signal.SIGTERM)
    wait_file(w, "/tmp/done")
    return [w.read_file(f"/tmp/r-{i}").decode() for i in range(THREADS)]


def _same(got: list[str], want: list[str]) -> None:
    for g, w in zip(got, want):
        assert g.splitlines() == w.splitlines()


def _check(report: list[str]) -> None:
    """What the program set, as each thread saw it (the source's own report must say so too)."""
    main, w1, w2 = report
    for r, name in zip(report, ("sig-main", "sig-w1", "sig-w2")):
        assert f"comm {name}\n" in r, r
        assert "handler on altstack 1\n" in r, r
        assert "rseq updated 1 again -1 errno EBUSY\n" in r, r
    assert "value 11" in main and "value 22" in main and "value 77" in main and "value 44" in main
    assert "value 101" in w1 and "value 102" in w1 and "value 201" in w2
    assert "timer to this thread 1 others 0\n" in w2, w2


def test_signal_state_of_every_thread_is_carried(family):
    ws, pid = _start(family)
    (kid,) = ws.fork(1)
    family.append(kid)
    child = _report(kid, pid)
    source = _report(ws, pid)
    _check(source)
    _same(child, source)


def test_signal_state_is_carried_by_a_held_template(family):
    ws, pid = _start(family)
    tpl = ws.snapshot()
    try:
        kids = tpl.fork(2)
        family.extend(kids)
        reports = [_report(k, pid) for k in kids]
    finally:
        tpl.close()
    source = _report(ws, pid)
    _check(source)
    for r in reports:
        _same(r, source)


GLIBC_RSEQ = r"""
import ctypes, errno, signal, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.pthread_self.restype = ctypes.c_void_p
offset = ctypes.c_long.in_dll(libc, "__rseq_offset").value

def registered():
    # glibc's own area: at __rseq_offset from the thread pointer (pthread_self on x86_64);
    # registering it again with glibc's arguments says EBUSY only while it is registered
    area = libc.pthread_self() + offset
    for size in (32, 20):
        if libc.syscall(334, ctypes.c_void_p(area), size, 0, 0x53053053) == -1 and ctypes.get_errno() == errno.EBUSY:
            return "EBUSY"
    return "not registered"

asked, answers = threading.Event(), []
def worker():
    asked.wait()
    answers.append(registered())
t = threading.Thread(target=worker)
t.start()
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
out("/tmp/ready", "")
signal.sigwait({signal.SIGUSR1})
asked.set()
t.join()
out("/tmp/rseq", f"main {registered()} thread {answers[0]}")
"""


def test_glibc_rseq_stays_registered_in_every_thread(family):
    ws = start_script(family, GLIBC_RSEQ, "/tmp/ready")
    pid = next(p.pid for p in ws.processes() if p.cmdline[:1] == ["python3"])
    kid = fork_one(family, ws)
    for w in (kid, ws):
        assert signal_and_read(w, pid, signal.SIGUSR1, "/tmp/rseq") == b"main EBUSY thread EBUSY"


TIMER_PENDING = r"""
import ctypes, signal, struct, time
lib = ctypes.CDLL(None, use_errno=True)
sig = signal.SIGRTMIN + 1
signal.pthread_sigmask(signal.SIG_BLOCK, {sig, signal.SIGUSR1})
for period_ms in (10, 0):  # id 0 periodic, id 1 one-shot: both expired, their signal pending
    ev = struct.pack("qiii", 0, sig, 0, 0).ljust(64, b"\0")
    tid = ctypes.c_int()
    assert lib.timer_create(1, ev, ctypes.byref(tid)) == 0
    assert lib.timer_settime(tid, 0, struct.pack("4q", 0, period_ms * 10**6, 0, 10**7), None) == 0
time.sleep(0.1)
out("/tmp/ready", "")
signal.sigwait({signal.SIGUSR1})
got = []
while (i := signal.sigtimedwait({sig}, 0)) is not None:
    got.append(f"{i.si_code}")
time.sleep(0.05)  # delivered, the periodic timer runs again: one signal, its expiries meanwhile overruns
while (i := signal.sigtimedwait({sig}, 0)) is not None:
    got.append(f"later {i.si_code}")
out("/tmp/got", " ".join(got))
"""


def test_a_timers_pending_signal_is_the_timers_own(family):
    """A timer's signal pending at the fork is queued by the clone's timer itself: one, as in
    the source, which counts further expiries as overruns, not as more signals."""
    ws = start_script(family, TIMER_PENDING, "/tmp/ready")
    pid = next(p.pid for p in ws.processes() if p.cmdline[:1] == ["python3"])
    kid = fork_one(family, ws)
    time.sleep(0.1)
    for w in (kid, ws):
        assert signal_and_read(w, pid, signal.SIGUSR1, "/tmp/got") == b"-2 -2 later -2"
