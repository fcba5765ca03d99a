"""File locks (fcntl's POSIX and OFD locks, flock's): set again in each clone on its copy of
the file, which is the child's own (reopened in the child's root): the child's processes see
them held, and the source's are independent of them.

A POSIX lock belongs to the process and goes with the first close of any descriptor of its
file, so the locks are set once every descriptor is in place (last of the per-process work).
An OFD or flock lock belongs to the open file: one shared by several processes is opened once
in the child, by the first, and the others take that open file (the lock with it).
"""

from __future__ import annotations

import struct
from types import SimpleNamespace

from ..._core._syscalls import KCMP_FILE, kcmp
from ...errors import ForkError
from ..plan import FdInfo, ProcPlan
from . import files_reg, sharing, shmem

_F_SETLK, _F_OFD_SETLK = 6, 37
_F_RDLCK, _F_WRLCK = 0, 1
_LOCK_SH, _LOCK_EX, _LOCK_NB = 1, 2, 4
_KINDS = {"POSIX", "OFDLCK", "FLOCK"}
_OF_FILE = {"OFDLCK", "FLOCK"}  # owned by the open file, not the process


def _refuse(p, f, why: str) -> ForkError:
    return ForkError(f"process {p.vpid} ({p.name}) fd {f.fd} ({f.target}) holds {why}",
                     pid=p.hostpid, step="plan")


def check_tree(procs) -> None:
    """Refuse, at plan time, locks that could not be set again as they are; find the open
    files with OFD or flock locks that several processes share."""
    # (proc, fd) of each open file with OFD or flock locks, first holder first
    holders: list[tuple[ProcPlan, FdInfo]] = []
    for p in procs:
        if p.is_init:
            continue
        for f in p.fds:
            if not f.locks or f.dup_of is not None:
                continue
            odd = [lk.kind for lk in f.locks if lk.kind not in _KINDS]
            if odd:
                raise _refuse(p, f, f"a {odd[0].lower()} lock, which a fork cannot carry")
            posix = any(lk.kind == "POSIX" for lk in f.locks)
            if f.handler is not files_reg.OPS and (f.handler is not shmem.OPS or posix):
                # a memfd's copy is also held by a descriptor closed at finish: that close
                # would drop a POSIX lock of the process that made it
                raise _refuse(p, f, "a POSIX lock on a memfd" if f.handler is shmem.OPS else
                              "a lock on something that is neither a regular file of the workspace "
                              "nor a memfd, which a fork cannot carry")
            if not any(lk.kind in _OF_FILE for lk in f.locks):
                continue
            for q, g in holders:
                try:
                    same = kcmp(p.hostpid, q.hostpid, KCMP_FILE, f.fd, g.fd) == 0
                except OSError:
                    same = False
                if same:
                    f.lock_shared_from = (q.vpid, g.fd)
                    f.handler = SHARED
                    break
            else:
                holders.append((p, f))


def fixup(ctx, proc, r, f) -> None:
    """A later holder of an open file with OFD or flock locks takes the first's (check_tree)."""
    r.install(sharing.grab(r, f.lock_shared_from), f)


def fixup_proc(ctx, proc, r) -> None:
    for f in proc.fds:
        if f.dup_of is not None:
            continue
        shared = getattr(f, "lock_shared_from", None) is not None
        for lk in f.locks:
            if shared and lk.kind in _OF_FILE:  # came with the open file
                continue
            if lk.kind == "FLOCK":
                r.queue("flock", f.fd, (_LOCK_EX if lk.write else _LOCK_SH) | _LOCK_NB)
                continue
            length = 0 if lk.end < 0 else lk.end - lk.start + 1  # 0: to the end, however long
            flock = struct.pack("hhqqi4x", _F_WRLCK if lk.write else _F_RDLCK, 0, lk.start, length, 0)
            r.queue("fcntl", f.fd, _F_SETLK if lk.kind == "POSIX" else _F_OFD_SETLK, r.queue_put(flock))


OPS = SimpleNamespace(kind="locks", plan_proc=lambda proc: None, fixup_proc=fixup_proc, check_tree=check_tree)
SHARED = SimpleNamespace(kind="locked-file", claims=lambda proc, f: False, fixup=fixup)
