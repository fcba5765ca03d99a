"""Per-thread state a clone's threads lack. compel recreates every thread but the main one
with its signal mask, alternate signal stack and rseq registration; the main thread is the
clone itself, made by a CLONE_VM intermediate, which keeps its mask but drops its alternate
stack and rseq registration: both are set again here (a clone of the module's FORK, which may
have kept them, is given the same again). Thread names
(comm) are not copied by a thread's clone (it takes the main thread's): each thread gets its
own back, written by the main thread (a thread may rename another of its own process only).
A thread with CPUs of its own (sched_setaffinity on that thread) gets them again.

A call blocked at the fork whose time left the kernel wrote into the thread's memory (select,
pselect6, ppoll; nanosleep and a relative clock_nanosleep where compel makes them again) is
taken up from there by the clone: that time left is counted down by the time since it was
written, so that the clone wakes at the source's deadline, also a template's clone long after
its snapshot (_count_down)."""

from __future__ import annotations

import errno
import logging
import os
import struct
import time
from dataclasses import dataclass
from types import SimpleNamespace

from ...compel import Tracee
from ...errors import BunshinError, ForkError
from ..remote import set_affinity

log = logging.getLogger(__name__)

_SS_DISABLE, _SS_ONSTACK = 2, 1
_STACK_T = struct.Struct("QiiQ")  # ss_sp, ss_flags, (padding), ss_size
_TASK_COMM_LEN = 16
_SYS_SIGALTSTACK = 131
_WORD = (1 << 64) - 1
_ERESTARTNOHAND, _ERESTART_RESTARTBLOCK = -514 & _WORD, -516 & _WORD
_SYSCALL_INSN_LEN = 2
# Blocked calls whose time left the kernel writes into the caller's memory when they are
# interrupted (by the fork's stop), and which the clone takes up from there: by number, the
# register pointing at it and its second field's unit. The select family is restarted as it
# stood (its timeval or timespec updated in place); nanosleep and a relative clock_nanosleep,
# in a thread other than the main one, are made again sleeping their time left (compel's
# _reissued; the main thread's clone restarts them from their deadline, as the source does).
_RESTARTED = {23: ("r8", 10**6), 270: ("r8", 10**9), 271: ("rdx", 10**9)}  # select, pselect6, ppoll
_REMADE = {35: ("rsi", "rdi"), 230: ("r10", "rdx")}  # nanosleep, clock_nanosleep: (time left, remade with)
_SYS_RESTART = 219  # restart_syscall: a sleep interrupted before (by an earlier fork)
_TIME_LEFT_CALLS = {*_RESTARTED, *_REMADE, _SYS_RESTART}
_WALL_CLOCKS = (0, 1, 7, 11)  # REALTIME, MONOTONIC, BOOTTIME, TAI: they ran on while it was stopped
_WRITTEN_MAX = 4096


@dataclass(frozen=True)
class Written:
    """A clone thread's time left as _count_down wrote it: where (``address``, which its
    register ``reg`` points at), in what ``unit``, ``when``, what (``value``), and the thread's
    registers then (``regs``: rip, rax, orig_rax)."""

    reg: str
    address: int
    unit: int
    when: float
    value: bytes
    regs: tuple[int, int, int]

    def pending(self, t, st) -> bool:
        """Whether thread state ``st`` (of Tracee ``t``) is that thread's, still about to take
        up its call with what was written: it has not run since (a snapshot's clone, a
        template, never runs; one that has run has left its call or had the kernel write its
        time left again)."""
        r = st.regs
        return ((r["rip"], r["rax"], r["orig_rax"]) == self.regs and r[self.reg] == self.address
                and t.read(self.address, len(self.value)) == self.value)


# By (host pid, tid): a template's later forks count down from when its snapshot's fork wrote it.
_WRITTEN: dict[tuple[int, int], Written] = {}


def vtid(hostpid: int, tid: int) -> int:
    """A thread's tid in its own pid namespace."""
    with open(f"/proc/{hostpid}/task/{tid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"NSpid:"):
                return int(line.split()[-1])
    raise ForkError(f"thread {tid} of {hostpid} has no NSpid", pid=hostpid, step="plan")


def _comm(hostpid: int, tid: int) -> bytes:
    with open(f"/proc/{hostpid}/task/{tid}/comm", "rb") as f:
        return f.read().rstrip(b"\n")


def _call_nr(hostpid: int, tid: int) -> int:
    """The system call the (frozen) thread is in, or -1: /proc's task syscall file."""
    try:
        with open(f"/proc/{hostpid}/task/{tid}/syscall", "rb") as f:
            nr = f.read().split(b" ", 1)[0]
    except OSError:
        return -1
    return int(nr) if nr.isdigit() else -1


def plan_proc(proc) -> None:
    # in a call whose time left the fork's stop takes (_count_down): frozen in it, or stopped
    # by the freezer with it to restart
    proc.time_left_tids = [t for t in proc.threads if _call_nr(proc.hostpid, t) in _TIME_LEFT_CALLS]
    # A frozen template runs none of its own code again: what is read here stays true.
    # the main thread's tid is the process's pid
    proc.thread_vtids = {t: proc.vpid if t == proc.hostpid else vtid(proc.hostpid, t) for t in proc.threads}
    main = _comm(proc.hostpid, proc.hostpid)
    proc.thread_names = {proc.thread_vtids[t]: name for t in proc.threads[1:]
                         if (name := _comm(proc.hostpid, t)) != main}
    # read on the first fork, in the template (by injection: ask; by ptrace)
    proc.main_altstack = proc.main_rseq = None


def ask(ctx, proc, q) -> None:
    """The main thread's alternate signal stack, for clones that lose it (fixup_proc), once."""
    if not ctx.cloner.through_intermediates or proc.main_altstack is not None:
        return

    def answer(got: list[int], raw: bytes) -> None:
        if got != [0]:
            raise ForkError(f"process {proc.vpid} ({proc.name}): sigaltstack() to read its "
                            f"alternate signal stack failed ({got})", pid=proc.hostpid, step="state")
        sp, flags, _pad, size = _STACK_T.unpack(raw)
        proc.main_altstack = (sp, flags, size)

    q.ask(_STACK_T.size, lambda addr, first: [(_SYS_SIGALTSTACK, (0, addr), Tracee.BATCH_OK_ERR)], answer)


def _time_left_at(st, remade) -> tuple[str, int, int] | None:
    """(register, address, unit) of the time left of thread state ``st``'s blocked call, where
    the clone's thread takes it up from memory (the register pointing at it there); ``remade``:
    that thread's registers (None: the main thread)."""
    regs, ret = st.regs, st.regs["rax"] & _WORD
    if not st.in_syscall:
        return None
    if ret == _ERESTARTNOHAND and regs["orig_rax"] in _RESTARTED:
        reg, unit = _RESTARTED[regs["orig_rax"]]
        return (reg, regs[reg], unit) if regs[reg] else None
    if (ret != _ERESTART_RESTARTBLOCK or remade is None or remade["orig_rax"] != _WORD
            or remade["rip"] != regs["rip"] - _SYSCALL_INSN_LEN or remade["rax"] not in _REMADE):
        return None
    left, arg = _REMADE[remade["rax"]]
    if not regs[left] or remade[arg] != regs[left]:
        return None  # made again with its whole time: the kernel wrote no time left
    if remade["rax"] == 230 and regs["rdi"] not in _WALL_CLOCKS:
        return None  # a CPU clock, which did not run while it was stopped
    return arg, regs[left], 10**9


def _count_down(ctx, proc, r) -> None:
    """The time left of each blocked call the clone takes up from memory, less the time since
    it was taken: in a template, when its snapshot's fork wrote it (_WRITTEN); else at the
    fork's first stop of the process (seize.seize_all's ``stopped_at``). Its clone then wakes at
    its source's deadline, as its main thread's nanosleep (whose restart block keeps the
    deadline) and its timers do: a little late (the time taken after the kernel's), never
    early."""
    src = ctx.shared["tracees"][proc.hostpid]
    stopped_at = proc.stopped_at
    found = []  # (tid, its state or its Written)
    for tid in proc.threads:
        written = _WRITTEN.get((proc.hostpid, tid))
        if written is not None:
            if written.pending(src, src.thread_state(tid)):
                found.append((tid, written))
                continue
            del _WRITTEN[proc.hostpid, tid]  # it has run since: the call is its own again
        if tid in proc.time_left_tids and stopped_at is not None:
            found.append((tid, src.thread_state(tid)))
    if not found:
        return
    child = r.t  # the queue first
    clone_tid = {vtid(child.pid, t): t for t in child.threads()}
    if len(_WRITTEN) > _WRITTEN_MAX:
        _WRITTEN.clear()  # templates of long ago: each counts from its next fork's stop then
    for tid, what in found:
        ctid = clone_tid[proc.thread_vtids[tid]]
        if isinstance(what, Written):
            at, taken = (what.reg, what.address, what.unit), what.when
        else:
            at = _time_left_at(what, None if tid == proc.hostpid else child.thread_state(ctid).regs)
            taken = stopped_at
        if at is None:
            continue
        reg, addr, unit = at
        sec, frac = struct.unpack("qq", child.read(addr, 16))
        now = time.monotonic()
        left = max(0, sec * unit + frac - int((now - taken) * unit))
        value = struct.pack("qq", *divmod(left, unit))
        child.write(addr, value)
        regs = child.thread_state(ctid).regs
        _WRITTEN[child.pid, ctid] = Written(reg, addr, unit, now, value, (regs["rip"], regs["rax"], regs["orig_rax"]))


def count_down_source(plans, tracees: dict, since: float) -> None:
    """The source's own blocked calls whose time left the freezer made them write to its
    memory (select, pselect, ppoll; ptrace-stopped in ``tracees`` by host pid), counted down by
    the time since ``since`` (once every task was frozen), as the kernel would have had the
    workspace not been held: they wake at their deadlines, a little late, never early."""
    for p in plans:
        t = tracees.get(p.hostpid)
        if t is None:
            continue
        for tid in getattr(p, "time_left_tids", ()):
            try:
                at = _time_left_at(t.thread_state(tid), None)
                if at is None:
                    continue
                _reg, addr, unit = at
                sec, frac = struct.unpack("qq", t.read(addr, 16))
                left = max(0, sec * unit + frac - int((time.monotonic() - since) * unit))
                t.write(addr, struct.pack("qq", *divmod(left, unit)))
            except BunshinError as e:  # gone meanwhile: it has no deadline left to keep
                log.warning("process %d thread %d: its blocked call's time left: %s", p.vpid, tid, e)


def fixup_proc(ctx, proc, r) -> None:
    _count_down(ctx, proc, r)
    # A clone made through a CLONE_VM intermediate has lost both (the kernel resets them for a
    # CLONE_VM child); one forked straight from its source (the module's FORK, REPARENT-only
    # injection) kept them, and queuing them there would only take its fixups out of RUN.
    if ctx.cloner.through_intermediates:
        if proc.main_rseq is None:
            proc.main_rseq = ctx.shared["tracees"][proc.hostpid].thread_state(proc.hostpid).rseq
        sp, flags, size = proc.main_altstack
        if not flags & _SS_DISABLE:
            # SS_ONSTACK is not a setting: the kernel tells it from the stack pointer
            r.queue("sigaltstack", r.queue_put(_STACK_T.pack(sp, flags & ~_SS_ONSTACK, 0, size)), 0)
        addr, length, sig, _flags = proc.main_rseq
        if addr:
            # EBUSY: registered already, at this address with this signature
            r.queue("rseq", addr, length, 0, sig, ok_errnos=(errno.EBUSY,))
    # a thread's own CPUs, where they are not its process's (seize.Pinned): a clone whose
    # fixups run in the kernel is not given its CPUs back after them (release_clone)
    for vtid, cpus in ctx.shared.get("thread_cpus", {}).get(proc.hostpid, {}).items():
        set_affinity(r, cpus, vtid)
    for vtid, name in proc.thread_names.items():
        fd = r.queue_openat(f"/proc/thread-self/../{vtid}/comm", os.O_WRONLY | os.O_CLOEXEC)
        r.queue("write", fd, r.queue_put(name[:_TASK_COMM_LEN - 1]), len(name[:_TASK_COMM_LEN - 1]))
        r.queue("close", fd)


OPS = SimpleNamespace(kind="thread-state", plan_proc=plan_proc, ask=ask, fixup_proc=fixup_proc)
