"""One module per kind of resource a fork must recreate, each registering a small ops table;
the engine loops over the table and never switches on the kind itself (CRIU's way).

Each ops table has ``claims(proc, fd) -> bool`` (plan: is this descriptor mine?), optional
``check_tree(procs)`` (plan: refuse what cannot be carried, before anything is touched) and
``fixup(ctx, proc, remote, fd)`` (act in the child's clone, stopped, inside the child's
namespaces).
"""

from __future__ import annotations

from ...errors import ForkError
from ..plan import FdInfo, ProcPlan, kind_of
from . import (control, devices, epoll, eventfd, files_reg, inotify, locks, memlock, namespaces, parent_death, pipes,
               ptys, shmem, signalfd, signals, sk_inet, sk_unix, subreaper, sysv_sem, sysv_shm, threads, timerfd,
               timers, unsupported, zombies)
from .questions import Questions, ask_cloexec

# Order matters: the first table that claims a descriptor owns it; "unsupported" is last.
REGISTRY = [control.OPS, files_reg.PATHS, ptys.OPS, pipes.OPS, devices.OPS, shmem.OPS, eventfd.OPS, signalfd.OPS,
            timerfd.OPS, inotify.OPS, epoll.OPS, sk_unix.OPS, sk_inet.OPS, namespaces.OPS, files_reg.OPS,
            unsupported.OPS]

# Per-process state beyond descriptors: plan_proc(proc) at snapshot, ask(ctx, proc, questions)
# of the template process before the fixups (questions.py), fixup_proc(ctx, proc, remote) in
# each clone, finish(ctx) once the child is whole; check_tree(procs) as above.
# memlock once every mapping is in place (one made again over a locked range is not locked).
# Locks once every descriptor is in place (terminals included): a close of the file before them
# would drop its POSIX locks. threads before timers and signals, which may target a thread;
# signals last of the fixups: a pending one may be delivered as soon as the clone runs an
# instruction of its own. zombies after them: made in finish, once the child's process tree and
# sessions are (their fixup only takes the parent's clone, flushing what is queued).
PROC_REGISTRY = [files_reg.CWD, epoll.PROC, inotify.PROC, shmem.MAPPINGS, sysv_shm.OPS, sysv_sem.OPS, memlock.OPS,
                 subreaper.OPS, parent_death.OPS, ptys.CTTY, locks.OPS, threads.OPS, timers.OPS, signals.OPS,
                 zombies.OPS]


def ask_template(ctx, proc: ProcPlan) -> None:
    """What the fixups of ``proc``'s clone need to know of its template process and /proc does
    not show: its descriptors' close-on-exec flags and the questions of every module's
    ``ask(ctx, proc, q)``, in one stop of it."""
    q = Questions(lambda: ctx.shared["tracees"][proc.hostpid])
    ask_cloexec(proc, q)
    for ops in PROC_REGISTRY:
        ask = getattr(ops, "ask", None)
        if ask is not None:
            ask(ctx, proc, q)
    q.run()


_FASYNC = 0o20000


def handler_for(proc: ProcPlan, f: FdInfo):
    # the owner and signal (F_SETOWN, F_SETSIG) are not to be read; a lease sets it for its
    # own signal (refused as a lease, locks.py)
    if f.flags & _FASYNC and not any(lk.kind == "LEASE" for lk in f.locks):
        raise ForkError(f"process {proc.vpid} ({proc.name}) fd {f.fd}: {kind_of(f)} with signal-driven "
                        "I/O (O_ASYNC): its owner and signal cannot be set again in the child, whose "
                        "process would wait for a SIGIO that never comes; turn O_ASYNC off before "
                        "forking", pid=proc.hostpid, step="plan")
    for ops in REGISTRY:
        if ops.claims(proc, f):
            return ops
    raise ForkError(f"process {proc.vpid} ({proc.name}) fd {f.fd}: a {kind_of(f)} no handler knows",
                    pid=proc.hostpid, step="plan")


def plan_procs(procs: list[ProcPlan]) -> None:
    for p in procs:
        if p.is_init:
            continue
        for ops in PROC_REGISTRY:
            ops.plan_proc(p)


def check_tree(procs: list[ProcPlan]) -> None:
    for ops in REGISTRY + PROC_REGISTRY:
        check = getattr(ops, "check_tree", None)
        if check is not None:
            check(procs)
