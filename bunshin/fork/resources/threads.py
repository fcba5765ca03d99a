"""Per-thread state a clone's threads lack. compel recreates every thread but the main one
with its signal mask, alternate signal stack and rseq registration; the main thread is the
clone itself, made by a CLONE_VM intermediate, which keeps its mask but drops its alternate
stack and rseq registration: both are set again here (a clone of the module's FORK, which may
have kept them, is given the same again). Thread names
(comm) are not copied by a thread's clone (it takes the main thread's): each thread gets its
own back, written by the main thread (a thread may rename another of its own process only).
A thread with CPUs of its own (sched_setaffinity on that thread) gets them again."""

from __future__ import annotations

import errno
import os
import struct
from types import SimpleNamespace

from ...compel import Tracee
from ...errors import ForkError
from ..remote import set_affinity

_SS_DISABLE, _SS_ONSTACK = 2, 1
_STACK_T = struct.Struct("QiiQ")  # ss_sp, ss_flags, (padding), ss_size
_TASK_COMM_LEN = 16
_SYS_SIGALTSTACK = 131


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


def plan_proc(proc) -> None:
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


def fixup_proc(ctx, proc, r) -> None:
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
