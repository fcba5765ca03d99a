"""SysV semaphore sets live in the workspace's IPC namespace (a fork gets a new, empty one):
every set is made there again with the same id (sem_next_id), key, owner, creator and mode and
the template's values. A semaphore's last operator (sempid) is the clone of the template's,
set by that clone itself with SETVAL; one whose last operator is not a template process shows
0. Undo adjustments (SEM_UNDO) are kept per process in the kernel and no interface reads them,
so a process that has any is refused; the change times (sem_otime, sem_ctime) are the child's
own."""

from __future__ import annotations

import ctypes
import errno
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

from ...errors import ForkError
from ..plan import has_undo_list
from .sysv_ipc import (IPC_CREAT, IPC_EXCL, IPC_SET, IPC_STAT, IpcPerm, Owner, check_creators, ids, in_ipc_ns,
                       libc, make_as, read_limits, write_limits)

_GETPID, _GETALL, _SETVAL, _SETALL = 11, 13, 16, 17
_LIMITS = ("sem",)  # semmsl semmns semopm semmni


class _SemidDs(ctypes.Structure):
    """The kernel's struct semid64_ds (x86_64)."""
    _fields_ = [("perm", IpcPerm), ("otime", ctypes.c_long), ("unused1", ctypes.c_ulong), ("ctime", ctypes.c_long),
                ("unused2", ctypes.c_ulong), ("nsems", ctypes.c_ulong), ("unused3", ctypes.c_ulong),
                ("unused4", ctypes.c_ulong)]


@dataclass
class SemSet:
    id: int
    key: int
    owner: Owner
    values: list[int]


@dataclass
class Sets:
    """The template's semaphore sets and the limits of its IPC namespace."""
    sets: list[SemSet]
    limits: dict[str, str]


def _semctl(semid: int, num: int, cmd: int, arg=None) -> int:
    r = libc.semctl(semid, num, cmd, arg) if arg is not None else libc.semctl(semid, num, cmd)
    if r < 0:
        raise OSError(ctypes.get_errno(), f"semctl({semid}, {num}, {cmd})")
    return r


def sets(init_hostpid: int, procs) -> Sets:
    """The template's sets; each process of ``procs`` learns which semaphores it operated on
    last (``sysv_sem_last``), and one with undo adjustments is refused."""
    def read():
        found: list[SemSet] = []
        last: dict[int, list[tuple[int, int, int]]] = {}
        for semid in ids("sem"):
            ds = _SemidDs()
            _semctl(semid, 0, IPC_STAT, ctypes.byref(ds))
            vals = (ctypes.c_ushort * ds.nsems)()
            _semctl(semid, 0, _GETALL, vals)
            for num in range(ds.nsems):
                last.setdefault(_semctl(semid, num, _GETPID), []).append((semid, num, vals[num]))
            found.append(SemSet(semid, ds.perm.key, Owner.of(ds.perm), list(vals)))
        return Sets(found, read_limits(_LIMITS) if found else {}), last

    out, last = in_ipc_ns(init_hostpid, read)
    if out.sets:  # else an undo list holds nothing: the kernel drops a set's entries with it
        check_creators([s.owner for s in out.sets], "semaphores")
        for p in procs:
            if not p.is_init:
                _check_undo(p)
                p.sysv_sem_last = last.get(p.hostpid, [])
    return out


def _check_undo(proc) -> None:
    """Refuse ``proc`` if it has an undo list (plan.has_undo_list). The adjustments themselves
    cannot be read."""
    for tid in proc.threads:
        if has_undo_list(tid):
            raise ForkError(f"process {proc.vpid} ({proc.name}) has used SEM_UNDO on a SysV semaphore: the kernel "
                            "keeps its undo adjustments (applied when it exits) where no interface reads them, so "
                            "its clone could not get them; use semop without SEM_UNDO, or end that process "
                            "before forking", pid=proc.hostpid, step="plan")


def copy_sets(child_init: int, tpl: Sets) -> None:
    """Make the template's sets in the child's IPC namespace, with their values."""
    if not tpl.sets:
        return

    def create():
        write_limits(tpl.limits)
        for s in sorted(tpl.sets, key=lambda s: s.id):
            n = len(s.values)
            make_as("sem", s.id, s.owner, partial(libc.semget, s.key, n, IPC_CREAT | IPC_EXCL | s.owner.mode))
            ds = _SemidDs()
            s.owner.set_on(ds.perm)
            _semctl(s.id, 0, IPC_SET, ctypes.byref(ds))
            _semctl(s.id, 0, _SETALL, (ctypes.c_ushort * n)(*s.values))

    in_ipc_ns(child_init, create)


def plan_proc(proc) -> None:
    pass  # sets() plans for every process at once, and only when the workspace has sets


def fixup_proc(ctx, proc, r) -> None:
    # SETVAL to the value it has makes the caller the semaphore's sempid. A process no longer
    # allowed to alter the set (its mode changed since) leaves the child's sempid 0.
    for semid, num, val in getattr(proc, "sysv_sem_last", ()):
        r.queue("semctl", semid, num, _SETVAL, val, ok_errnos=(errno.EACCES, errno.EPERM))


OPS = SimpleNamespace(kind="sysv-sem", plan_proc=plan_proc, fixup_proc=fixup_proc)
