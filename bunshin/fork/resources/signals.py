"""Pending signals: fork(2) starts the child with none, so the signals pending in the template
at the moment of the fork are queued again in the clone, each with its siginfo (sender, code,
value), in their order, on the queue they were on: the process's shared one or one thread's.
A template process stopped by a signal (kill -STOP, Ctrl-Z) has its clone stopped too: SIGCONT
resumes either.

The queues are read with PTRACE_PEEKSIGINFO. The kernel lets a process queue any siginfo to
itself (rt_sigqueueinfo to its own pid, rt_tgsigqueueinfo to its own tid), but another thread
only a siginfo that claims no kernel or kill() origin: so the clone's main thread queues the
shared queue and its own, and each other thread's signals are queued by the kernel in that
thread, at a ptrace signal-delivery stop, as a tracer's changed signal that the thread blocks
(ptrace_signal() queues it again, siginfo and all)."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from types import SimpleNamespace

from ...errors import ForkError
from .threads import vtid

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.restype = ctypes.c_long
_libc.ptrace.argtypes = (ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p)

PTRACE_CONT, _PTRACE_SETSIGINFO, _PTRACE_INTERRUPT = 7, 0x4203, 0x4207
_PTRACE_PEEKSIGINFO, PTRACE_GETSIGMASK, PTRACE_SETSIGMASK = 0x4209, 0x420A, 0x420B
_PEEKSIGINFO_SHARED = 1
_PTRACE_EVENT_STOP = 128
_WALL = 0x40000000
_SIGINFO = 128  # bytes of a siginfo_t
_PEEK_BATCH = 64
_ALL = (1 << 64) - 1
# Signals to stop a thread with, best first: a standard one is pending even when the kernel has
# no room for its siginfo (RLIMIT_SIGPENDING); none that cannot be caught, that has side
# effects on being sent (the job-control ones) or that the clone's timers or children may send
# meanwhile (the thread would take that one instead).
_TRIGGERS = [s for s in (*range(31, 0, -1), *range(64, 31, -1))
             if s not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCONT, signal.SIGTSTP, signal.SIGTTIN,
                          signal.SIGTTOU, signal.SIGALRM, signal.SIGVTALRM, signal.SIGPROF, signal.SIGCHLD)]


class _PeekArgs(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("nr", ctypes.c_int32)]


def ptrace(req: int, tid: int, addr, data, what: str, step: str = "signals") -> int:
    """ptrace(2) on a thread this thread traces; ForkError (``what``, ``step``) if it fails."""
    r = _libc.ptrace(req, tid, addr, data)
    if r < 0:
        e = ctypes.get_errno()
        raise ForkError(f"thread {tid}: {what}: {os.strerror(e)}", pid=tid, step=step, errno=e)
    return r


def sigmask(tid: int, step: str = "signals") -> int:
    """The blocked-signal mask of a ptrace-stopped thread."""
    mask = ctypes.c_uint64()
    ptrace(PTRACE_GETSIGMASK, tid, ctypes.c_void_p(8), ctypes.byref(mask), "PTRACE_GETSIGMASK", step)
    return mask.value


def set_sigmask(tid: int, mask: int, step: str = "signals", *, check: bool = True) -> None:
    """Set a ptrace-stopped thread's blocked-signal mask (``check``: raise if it fails)."""
    m = ctypes.c_uint64(mask)
    if check:
        ptrace(PTRACE_SETSIGMASK, tid, ctypes.c_void_p(8), ctypes.byref(m), "PTRACE_SETSIGMASK", step)
    else:
        _libc.ptrace(PTRACE_SETSIGMASK, tid, ctypes.c_void_p(8), ctypes.byref(m))


def _queue(tid: int, flags: int) -> list[bytes]:
    """The siginfos queued on a (ptrace-stopped) thread's own queue, or with
    PEEKSIGINFO_SHARED its process's, oldest first."""
    out: list[bytes] = []
    buf = ctypes.create_string_buffer(_SIGINFO * _PEEK_BATCH)
    while True:
        args = _PeekArgs(len(out), flags, _PEEK_BATCH)
        n = ptrace(_PTRACE_PEEKSIGINFO, tid, ctypes.byref(args), buf, "PTRACE_PEEKSIGINFO")
        out += [buf.raw[i * _SIGINFO:(i + 1) * _SIGINFO] for i in range(n)]
        if n < _PEEK_BATCH:
            return out


def _signo(info: bytes) -> int:
    return int.from_bytes(info[:4], "little", signed=True)


def _masks(hostpid: int, tid: int) -> tuple[int, int]:
    """(the thread's own, its process's shared) pending signals, from one read of its status
    (found by key, not parsed line by line: this runs for every thread of every fork)."""
    with open(f"/proc/{hostpid}/task/{tid}/status", "rb") as f:
        status = f.read()
    masks = []
    for key in (b"\nSigPnd:", b"\nShdPnd:"):
        at = status.find(key)
        masks.append(int(status[at + len(key):status.index(b"\n", at + 1)], 16) if at >= 0 else 0)
    return masks[0], masks[1]


def _unqueued(mask: int, queued: list[bytes]) -> list[bytes]:
    """Siginfos for signals pending without a queue entry (the kernel had no room for one):
    the kernel makes such a signal's siginfo up as this one when it is taken."""
    for info in queued:
        mask &= ~(1 << (_signo(info) - 1))
    return [sig.to_bytes(4, "little") + bytes(_SIGINFO - 4)  # si_code SI_USER, no sender
            for sig in range(1, 65) if mask >> (sig - 1) & 1]


def _pending(tid: int, mask: int, flags: int = 0) -> list[bytes]:
    """The siginfos of the signals ``mask`` says are pending on a thread's own queue (or with
    PEEKSIGINFO_SHARED its process's)."""
    if not mask:  # every queued signal shows in it: none to peek at (the common case)
        return []
    queued = _queue(tid, flags)
    return queued + _unqueued(mask, queued)


def _template_queues(proc) -> tuple[list[bytes], dict[int, list[bytes]]]:
    """A template process's pending signals: (its shared queue, {host tid: that thread's})."""
    own, shared = _masks(proc.hostpid, proc.hostpid)
    queues = {proc.hostpid: _pending(proc.hostpid, own)}
    for t in proc.threads[1:]:
        queues[t] = _pending(t, _masks(proc.hostpid, t)[0])
    return _pending(proc.hostpid, shared, _PEEKSIGINFO_SHARED), queues


_SI_TIMER = -2


def _timer_id(info: bytes) -> int | None:
    """The POSIX timer whose expiry queued this siginfo, if one did (si_tid)."""
    if int.from_bytes(info[8:12], "little", signed=True) != _SI_TIMER:
        return None
    return int.from_bytes(info[16:20], "little", signed=True)


def timers_pending(proc) -> set[int]:
    """Ids of the POSIX timers whose signal is pending in the template process."""
    shared, own = _template_queues(proc)
    return {i for q in (shared, *own.values()) for info in q if (i := _timer_id(info)) is not None}


def plan_proc(proc) -> None:
    pass  # read at fork time: the template may have been signalled since the snapshot


def fixup_proc(ctx, proc, r) -> None:
    def mine(infos: list[bytes]) -> list[bytes]:  # a re-fired timer queues its own (timers.py)
        return [i for i in infos if _timer_id(i) not in proc.timers_refired]

    shared, own = _template_queues(proc)
    shared, own = mine(shared), {t: mine(q) for t, q in own.items()}
    others = {proc.thread_vtids[t]: q for t, q in own.items() if q and t != proc.hostpid}
    if others:
        _queue_in_threads(r.t, proc, others)
    for info in shared:
        r.queue("rt_sigqueueinfo", proc.vpid, _signo(info), r.queue_put(info))
    for info in own[proc.hostpid]:
        r.queue("rt_tgsigqueueinfo", proc.vpid, proc.vpid, _signo(info), r.queue_put(info))
    if proc.group_stopped:
        # SIGSTOP whatever stopped the template process: the job-control stops (SIGTSTP...)
        # do nothing in an orphaned process group, which the clone's may be where the
        # template's is not (a clone keeps its template's session without the module).
        # Held while the clone is traced, it stops it once let go; its parent sees that stop.
        r.queue("kill", proc.vpid, signal.SIGSTOP)


def _queue_in_threads(clone, proc, queues: dict[int, list[bytes]]) -> None:
    """Queue each thread's signals (``{vtid: siginfos}``) on its copy in ``clone``, all of
    whose threads we trace, stopped."""
    by_vtid = {vtid(clone.pid, tid): tid for tid in clone.threads()}
    for thread, infos in queues.items():
        tid = by_vtid.get(thread)
        if tid is None:
            raise ForkError(f"process {proc.vpid} ({proc.name}): thread {thread} has signals pending "
                            "but no copy in the clone", pid=proc.hostpid, step="signals")
        who = f"process {proc.vpid} ({proc.name}), thread {thread} of its clone"
        _queue_in_thread(who, clone.pid, tid, infos, getattr(proc, "posix_timers", ()))


def _queue_in_thread(who: str, pid: int, tid: int, infos: list[bytes], timers) -> None:
    """The thread runs to a signal-delivery stop for a trigger signal, the only one it lets
    through; there we swap in the siginfo to queue, block everything and let it go with that
    signal, which the kernel queues on the thread again, untouched; an interrupt asked for
    beforehand stops the thread again before it could return to its code."""
    mask = sigmask(tid)
    own, shared = _masks(pid, tid)
    busy = own | shared
    for sig in [_signo(info) for info in infos] + [t.signo for t in timers]:
        busy |= 1 << (sig - 1)
    trigger = next((s for s in _TRIGGERS if not busy >> (s - 1) & 1), 0)
    if not trigger:
        raise ForkError(f"thread {tid}: every signal is pending, none is left to stop it with",
                        pid=pid, step="signals")
    try:
        for info in infos:
            set_sigmask(tid, _ALL & ~(1 << (trigger - 1)))
            if _libc.syscall(234, pid, tid, trigger) != 0:  # tgkill
                raise ForkError(f"thread {tid}: tgkill: {os.strerror(ctypes.get_errno())}", pid=pid,
                                step="signals")
            ptrace(PTRACE_CONT, tid, None, None, "PTRACE_CONT")
            _expect(who, pid, tid, lambda st: os.WSTOPSIG(st) == trigger and st >> 16 == 0,
                    f"signal {trigger}")
            data = ctypes.create_string_buffer(info, _SIGINFO)
            ptrace(_PTRACE_SETSIGINFO, tid, None, data, "PTRACE_SETSIGINFO")
            set_sigmask(tid, _ALL)
            ptrace(_PTRACE_INTERRUPT, tid, None, None, "PTRACE_INTERRUPT")
            ptrace(PTRACE_CONT, tid, None, ctypes.c_void_p(_signo(info)), "PTRACE_CONT")
            _expect(who, pid, tid, lambda st: st >> 16 == _PTRACE_EVENT_STOP, "the interrupt")
    except BaseException:
        # a thread that did not stop cannot have its mask set; its clone is discarded anyway
        set_sigmask(tid, mask, check=False)
        raise
    set_sigmask(tid, mask)
    # ptrace_signal() drops a signal it cannot queue (RLIMIT_SIGPENDING) without a word
    # (a timer of the clone's may have queued one of its own meanwhile)
    got = iter(_queue(tid, 0))
    if not all(info in got for info in infos):
        raise ForkError(f"thread {tid}: the kernel did not queue all its {len(infos)} pending "
                        "signals again (RLIMIT_SIGPENDING?)", pid=pid, step="signals")


# How long a clone's thread, let go with one signal unblocked, may take to stop for it (or for
# the interrupt after it): it does at once, unless something outside the fork holds it (a
# freezer, an uninterruptible sleep), and the fork fails past it rather than hang.
EXPECT_TIMEOUT = 5.0


def _expect(who: str, pid: int, tid: int, ok, what: str) -> None:
    """Collect the next ptrace stop of thread ``tid`` (``who`` names it), which must be the
    one ``ok`` accepts. Polled, not waited for: a blocking waitpid would have no bound."""
    deadline = time.monotonic() + EXPECT_TIMEOUT
    delay = 0.00002
    while True:
        done, st = os.waitpid(tid, _WALL | os.WNOHANG)
        if done:
            break
        if time.monotonic() >= deadline:
            raise ForkError(f"{who}: did not stop for {what} within {EXPECT_TIMEOUT:g} s while "
                            "its signals were queued again (frozen, or in uninterruptible sleep?)",
                            pid=pid, step="signals")
        time.sleep(delay)
        delay = min(delay * 2, 0.005)
    if not os.WIFSTOPPED(st) or not ok(st):
        raise ForkError(f"{who}: stopped for {st:#x}, not for {what}, while its signals were "
                        "queued again", pid=pid, step="signals")


OPS = SimpleNamespace(kind="pending-signals", plan_proc=plan_proc, fixup_proc=fixup_proc)
