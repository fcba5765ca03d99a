"""Stopping a template's processes for a fork, and letting them go after it.

The template's cgroup is frozen between forks. A fork seizes every process while frozen, thaws
the group so that each stops under ptrace before running a single instruction, pins them and
the engine to one CPU, and at the end cures, freezes and detaches them again — or, for a
template the user holds, keeps them seized and frozen for the next fork (keeper.py).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import struct
import threading
import time
from collections.abc import Sequence

from ..compel import Tracee, in_group_stop, suspends_seccomp
from ..errors import BunshinError, ForkError
from . import keeper
from .perprocess import PerProcess
from .plan import ProcPlan, proc_status, seccomp_filters
from .remote import Remote

log = logging.getLogger("bunshin.fork")

_WALL = 0x40000000
_WNOHANG = 1


def check_seccomp(plans: list[ProcPlan]) -> None:
    """Refuse to fork a process that added seccomp filters of its own when seizes cannot
    suspend them: the fork's injected calls could be refused, or kill it. Filters every
    process inherited from the trainer allow what the trainer itself does, so they are no
    reason to refuse; nor are the init's, a sandbox's (bunshin.sandbox), which every process
    inherits: they deny no call the fork makes."""
    if suspends_seccomp() is not False:
        return
    own = max(seccomp_filters(proc_status("self")), plans[0].seccomp_filters)
    filtered = next((pl for pl in plans if pl.seccomp_filters > own), None)
    if filtered is not None:
        raise ForkError(
            f"process {filtered.vpid} ({filtered.name}) runs under a seccomp filter of its own and "
            "this trainer cannot suspend filters while it forks (that needs CAP_SYS_ADMIN and a "
            "trainer not under seccomp itself): the fork's system calls could be refused or kill "
            "it. Run the trainer unfiltered (e.g. a privileged container)", pid=filtered.hostpid,
            step="seize")


def seize_all(cg, plans: list[ProcPlan]) -> dict[int, Tracee]:
    """Stop every process of a frozen cgroup under ptrace, then thaw it: each process stops
    before it can run user code again. One stopped by a signal is seized only after the thaw
    (frozen, its attach would never finish): its group stop keeps it from running meanwhile.
    ``group_stopped`` of each plan says which are. On failure the group is left frozen and
    nothing seized, but for a process whose stop never came: it is let go once it stops
    (:func:`stragglers`). Each wait for a ptrace stop is bounded: ForkError naming the process."""
    stragglers().check(plans)
    tracees: dict[int, Tracee] = {}
    stopped: set[int] = set()
    waited_out: set[int] = set()  # not stopped within STOP_TIMEOUT: not waited for again
    seen = [_stopped(pl.hostpid) for pl in plans]
    for pl, stop in zip(plans, seen):
        pl.group_stopped = bool(stop)
    try:
        for pl, stop in zip(plans, seen):
            if stop is None:
                _seize_watched(cg, pl, tracees)
            elif not stop:
                _seize(pl, tracees)
                if len(pl.threads) > 1:  # else they would run between the thaw and stop_all
                    tracees[pl.hostpid].seize_threads()
        cg.thaw()
        for pl in plans:
            if pl.group_stopped:
                _seize(pl, tracees)
        tracees = {pl.hostpid: tracees[pl.hostpid] for pl in plans}
        for pl in plans:
            try:
                # also one whose group stop the freezer did not show: let go while frozen,
                # it is in it again only once thawed
                pl.group_stopped |= bool(tracees[pl.hostpid].wait_stopped(STOP_TIMEOUT))
            except ForkError as e:
                waited_out.add(pl.hostpid)
                raise _stop_error(pl, e) from None
            stopped.add(pl.hostpid)
        for pl in plans:
            try:
                tracees[pl.hostpid].stop_all()
            except ForkError as e:
                raise _stop_error(pl, e, tracees[pl.hostpid].late) from None
        for pl in plans:  # a blocked call's time left was taken by the first (resources/threads.py)
            if pl.stopped_at is None:
                pl.stopped_at = time.monotonic()
        check_seccomp(plans)  # the first seize of this trainer has told whether it can
    except BaseException:
        waited_out |= _let_stop(cg, tracees, stopped | waited_out)
        unstopped = [tracees.pop(pid) for pid in waited_out if pid in tracees]
        release_all(cg, tracees)
        stragglers().add(unstopped + [t for t in tracees.values() if t.late])
        raise
    return tracees


def _stopped(pid: int) -> bool | None:
    """in_group_stop, or a SIGSTOP queued and not yet taken (a template made of an unrun fork
    of a stopped process holds one: it stops before its next instruction, as if stopped)."""
    stop = in_group_stop(pid)
    if stop:
        return stop
    bit = 1 << (signal.SIGSTOP - 1)
    try:
        # the process's status shows its main thread's own queue beside the shared one
        st = proc_status(pid)
        if (int(st["ShdPnd"], 16) | int(st["SigPnd"], 16)) & bit:
            return True
        if int(st["Threads"]) > 1 and any(
                int(proc_status(f"{pid}/task/{t}")["SigPnd"], 16) & bit
                for t in os.listdir(f"/proc/{pid}/task") if t != str(pid)):
            return True
    except (OSError, KeyError, ValueError):
        pass
    return stop


# How long a seized process may take to reach its ptrace stop once thawed, and a frozen one's
# attach to return: a process in uninterruptible sleep (a vfork parent, a wait on a device)
# reaches neither until it wakes, and the fork fails past it rather than hang.
STOP_TIMEOUT = 10.0


def _seize_watched(cg, pl: ProcPlan, tracees: dict[int, Tracee]) -> None:
    """Seize a frozen process that /proc/PID/wchan cannot tell (a kernel without kallsyms):
    stopped by a signal, its attach waits for a thaw that comes only after it. Past
    STOP_TIMEOUT a timer of this attempt thaws the group, which lets the attach return (the
    process, attached now, is let go with the others), and the fork fails naming it."""
    watch = _AttachWatch(cg)
    try:
        _seize(pl, tracees)
    finally:
        fired = watch.cancel()
    if fired:
        raise ForkError(f"process {pl.vpid} ({pl.name}): its ptrace attach did not return within "
                        f"{STOP_TIMEOUT:g} s while the workspace was frozen (stopped by a signal? "
                        "this kernel's /proc/PID/wchan cannot tell): resume it (SIGCONT) and "
                        "fork again", pid=pl.hostpid, step="seize")


class _AttachWatch:
    """One seize attempt's timer: it thaws the group unless cancelled first, and tells which
    happened (one that fires after the attempt is over does nothing)."""

    def __init__(self, cg) -> None:
        self._cg = cg
        self._lock = threading.Lock()
        self._armed = True
        self._fired = False
        self._timer = threading.Timer(STOP_TIMEOUT, self._thaw)
        self._timer.daemon = True
        self._timer.start()

    def _thaw(self) -> None:
        with self._lock:
            if not self._armed:
                return
            self._fired = True
        try:
            self._cg.thaw()
        except BunshinError as e:
            log.warning("thawing to release a seize: %s", e)

    def cancel(self) -> bool:
        """Whether the timer thawed the group (its thaw is over when this returns)."""
        with self._lock:
            self._armed = False
        self._timer.cancel()
        self._timer.join()
        return self._fired


def _seize(pl: ProcPlan, tracees: dict[int, Tracee]) -> None:
    try:
        tracees[pl.hostpid] = Tracee.seize_frozen(pl.hostpid, STOP_TIMEOUT)
    except ForkError as e:
        raise _seize_error(pl, e) from None


def _stop_error(pl: ProcPlan, e: ForkError, late: Sequence[int] = ()) -> ForkError:
    if e.step == "stop_all" and e.errno == errno.ETIMEDOUT:
        tids = ", ".join(str(_own_tid(t)) for t in late) or "?"
        return ForkError(f"process {pl.vpid} ({pl.name}): thread {tids} did not reach a ptrace stop "
                         f"within {STOP_TIMEOUT:g} s of being seized (in uninterruptible sleep?): "
                         "the fork needs every thread stopped. It is let go as soon as it stops: "
                         "fork again then", pid=pl.hostpid, step="stop_all", errno=e.errno)
    if e.step != "wait" or e.errno:
        return e
    return ForkError(f"process {pl.vpid} ({pl.name}) did not reach a ptrace stop within "
                     f"{STOP_TIMEOUT:g} s of being seized (in uninterruptible sleep?): the fork "
                     "needs every process stopped. It is let go as soon as it stops: fork again "
                     "then", pid=pl.hostpid, step="wait")


def _own_tid(tid: int) -> int:
    """A host tid as its own pid namespace numbers it (the workspace's)."""
    try:
        return int(proc_status(tid)["NSpid"].split()[-1])
    except (OSError, KeyError, ValueError):
        return tid


def _seize_error(pl: ProcPlan, e: ForkError) -> ForkError:
    what = f"process {pl.vpid} ({pl.name})"
    if e.errno == errno.EPERM:
        try:
            tracer = int(proc_status(pl.hostpid).get("TracerPid", "0"))
        except (OSError, ValueError):
            tracer = 0
        if tracer:
            msg = (f"{what} is traced by host process {tracer} (a debugger?) and a process has one "
                   "tracer: detach it, then fork again")
        else:
            msg = f"{what} refused ptrace (Yama's ptrace_scope, or a missing CAP_SYS_PTRACE?)"
    else:
        msg = f"{what} could not be seized: {os.strerror(e.errno) if e.errno else e}"
    return ForkError(msg, pid=pl.hostpid, step="seize", errno=e.errno)


def _let_stop(cg, tracees: dict[int, Tracee], done: set[int]) -> set[int]:
    """A seized task can be let go only from a ptrace stop: after a failure before every
    seized process stopped, the others (not in ``done``: stopped, or waited for in vain) are
    let reach theirs (a dead one is skipped), all within one STOP_TIMEOUT. Returns the pids of
    those that did not (attached still, their stop still asked for)."""
    rest = [t for pid, t in tracees.items() if pid not in done]
    if not rest:
        return set()
    try:
        cg.thaw()
    except BunshinError as e:
        log.warning("thawing to let go of the seized processes: %s", e)
        return {t.pid for t in rest}
    deadline = time.monotonic() + STOP_TIMEOUT
    late = set()
    for t in rest:
        try:
            t.wait_stopped(max(deadline - time.monotonic(), 0.0))
        except ForkError as e:
            log.warning("template process %d did not stop: %s", t.pid, e)
            if e.step == "wait" and not e.errno:
                late.add(t.pid)
    return late


class Pinned:
    """The engine thread and every seized task on one CPU for the length of a fork batch: a
    ptrace round trip between two CPUs costs ~5x one on a single CPU (a wake-up IPI each way,
    measured 95-110 us vs 18-20 us here). Original affinities are put back, clones included."""

    def __init__(self, tracees: dict[int, Tracee]) -> None:
        self.saved: dict[int, set[int]] = {}
        mine = os.sched_getaffinity(0)
        self.cpu = min(mine)
        self.saved[0] = mine
        self.of_pid: dict[int, set[int]] = {}
        # a thread's own CPUs (sched_setaffinity on one thread) where they are not its
        # process's, by tid in the workspace (a clone's threads have the same)
        self.of_thread: dict[int, dict[int, set[int]]] = {}
        try:
            os.sched_setaffinity(0, {self.cpu})
            for pid, t in tracees.items():
                for tid in t.threads():
                    try:
                        self.saved[tid] = os.sched_getaffinity(tid)
                        os.sched_setaffinity(tid, {self.cpu})
                    except OSError:
                        pass
                self.of_pid[pid] = self.saved.get(pid, mine)
                own = {_vtid(tid): self.saved[tid] for tid in t.threads()
                       if tid != pid and self.saved.get(tid, self.of_pid[pid]) != self.of_pid[pid]}
                if own:
                    self.of_thread[pid] = own
        except BaseException:
            self.restore()
            raise

    def repin_engine(self) -> None:
        """Pin the calling (engine) thread again, for a later batch of the same tracees."""
        os.sched_setaffinity(0, {self.cpu})

    def release_clone(self, template_pid: int, clone: Tracee, away: bool = False) -> None:
        """A clone inherited the pin from its template process: give it the original back
        (``away``: without the engine's CPU, when it has others, so that it runs beside the
        engine rather than preempting it; release it again later)."""
        cpus = self.of_pid.get(template_pid)
        if cpus is None:
            return
        own = self.of_thread.get(template_pid, {})
        try:
            tids = clone.threads()
        except BunshinError:
            tids = [clone.pid]
        for tid in tids:
            mask = own.get(_vtid(tid), cpus) if own and tid != clone.pid else cpus
            if away and len(mask) > 1:
                mask = mask - {self.cpu}
            try:
                os.sched_setaffinity(tid, mask)
            except OSError:
                pass

    def restore(self) -> None:
        for tid, cpus in self.saved.items():
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:
                pass
        self.saved.clear()


def _vtid(tid: int) -> int:
    """A task's tid in its own pid namespace (0 once it is gone)."""
    try:
        return int(proc_status(tid)["NSpid"].split()[-1])
    except (OSError, KeyError):
        return 0


def release_all(cg, tracees: dict[int, Tracee], frozen: bool = True) -> None:
    """Freeze the group while its processes are ptrace-stopped, then detach: they stay frozen
    (``frozen`` False: they run on as each is detached). Curing comes first: it may inject
    (re-queue held signals), which a frozen task cannot run."""
    for t in tracees.values():
        try:
            t.cure()
        except BunshinError as e:
            log.warning("curing template process %d: %s", t.pid, e)
    if frozen:
        cg.freeze()
    for t in tracees.values():
        try:
            t.detach()
        except BunshinError as e:
            log.warning("detaching template process %d: %s", t.pid, e)


class Stragglers:
    """Template processes a failed fork seized and waited for in vain (a process or one of its
    threads in uninterruptible sleep): a thread can be let go only from a ptrace stop, so each
    such stays attached to the fork thread, its stop still asked for, until it reaches it; the
    fork thread then lets it go (as compel does, any signal met on the way is delivered).
    Checked in the fork thread's idle time, more rarely the longer it takes, and before every
    seize."""

    def __init__(self) -> None:
        self.tracees: dict[int, Tracee] = {}  # by host pid; used in the fork thread only
        self._ticking = False

    def add(self, tracees: list[Tracee]) -> None:
        for t in tracees:
            self.tracees[t.pid] = t
        if self.tracees and not self._ticking:
            self._ticking = True
            self._tick_later(SWEEP_FIRST_S)

    def _tick_later(self, delay: float) -> None:
        timer = threading.Timer(delay, keeper.fork_thread().post, (self._tick, delay))
        timer.daemon = True
        timer.start()

    def _tick(self, delay: float) -> None:
        self.sweep()
        self._ticking = bool(self.tracees)
        if self._ticking:
            self._tick_later(min(delay * 2, SWEEP_MAX_S))

    def sweep(self) -> None:
        """Let go of each straggler that has stopped (or is gone) since: detach collects the
        stop of each thread that has reached it and keeps the others attached (late)."""
        for pid, t in list(self.tracees.items()):
            try:
                t.detach()
            except BunshinError as e:
                log.warning("letting go of template process %d: %s", pid, e)
            if not t.late:
                del self.tracees[pid]

    def check(self, plans: list[ProcPlan]) -> None:
        """Refuse to seize a process still attached from an earlier fork's failure."""
        if not self.tracees:
            return
        self.sweep()
        stuck = next((pl for pl in plans if pl.hostpid in self.tracees), None)
        if stuck is not None:
            raise ForkError(f"process {stuck.vpid} ({stuck.name}) has not reached the ptrace stop an "
                            "earlier fork asked for (in uninterruptible sleep?): it stays attached "
                            "until it does, and cannot be forked before", pid=stuck.hostpid,
                            step="seize")


# A straggler is checked after SWEEP_FIRST_S, then at twice the last interval, up to
# SWEEP_MAX_S: one that wakes soon is let go soon, one that sleeps long costs little.
SWEEP_FIRST_S = 0.01
SWEEP_MAX_S = 1.0

_stragglers = PerProcess(Stragglers)


def stragglers() -> Stragglers:
    s = _stragglers.get()
    assert s is not None
    return s


def reap_children(init: Tracee, due: int) -> int:
    """Reap, inside the template's init, the inits of children that have exited: they are its
    children (the clone3 that made them ran there) and it is frozen, so it never would. One
    batch of ``due`` + 1 non-blocking wait4 calls, in one stop; returns how many it reaped."""
    n = min(due + 1, Tracee.max_calls())
    rets = init.calls([(61, (-1, 0, _WNOHANG | _WALL, 0), Tracee.BATCH_OK_ERR)] * n)  # wait4
    return sum(1 for r in rets if r > 0)


def _ignores_sigchld(pid: int) -> bool:
    return bool(int(proc_status(pid)["SigIgn"], 16) & (1 << (signal.SIGCHLD - 1)))


def ignore_children(init: Tracee) -> bool:
    """Set SIGCHLD to SIG_IGN in the template's init (frozen for good: it never runs its own
    code again), so that the kernel reaps its children as they die: the inits of closed
    children, and the intermediates made with CLONE_PARENT from its own children
    (engine.make_mid). Without this each is a zombie until a wait4 injected there. The
    child inits cloned from it set SIGCHLD back as they move into their root (init.c).
    Returns whether it is set (a process that refused it keeps the old way)."""
    if _ignores_sigchld(init.pid):
        return True  # set already (a template restored from images saved after its first fork)
    r = Remote(init, "the template's init")
    try:
        act = r.queue_put(struct.pack("=QQQQ", 1, 0, 0, 0))  # SIG_IGN, no flags, restorer, mask
        r.queue("rt_sigaction", signal.SIGCHLD, act, 0, 8)
        r.flush()
    except ForkError as e:
        log.warning("the template's init keeps its SIGCHLD (its children are reaped by hand): %s", e)
        return False
    finally:
        r.release()
    return _ignores_sigchld(init.pid)
