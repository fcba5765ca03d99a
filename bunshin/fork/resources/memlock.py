"""Locked memory: a clone, as a fork(2) child, has none of its template's mlock()ed mappings
locked (the kernel drops VM_LOCKED from a copied mapping) nor its mlockall(MCL_FUTURE) (the
mm's default flags, reset in a new mm). Both are set again in the clone: each locked range
(VmFlags "lo" in smaps, "lf" for MLOCK_ONFAULT) with mlock2, the default with mlockall.

Locking a writable private range in the clone copies its pages there (mlock faults them in for
writing), as it would after fork(2) and an mlock of the child's.

The default is not shown anywhere in /proc: it is asked of the template by a probe, a page it
maps, tries, and unmaps again in one stop (madvise(MADV_DONTNEED) refuses a locked mapping;
mincore tells a populated one, locked at once, from one locked on fault).
"""

from __future__ import annotations

import errno
import mmap
from types import SimpleNamespace

from ...compel import Tracee
from ...errors import ForkError
from ..plan import status_of

_MLOCK_ONFAULT = 1
_MCL_FUTURE, _MCL_ONFAULT = 2, 4
_SYS_MMAP, _SYS_MUNMAP, _SYS_MINCORE, _SYS_MADVISE = 9, 11, 27, 28
_PAGE = 4096
_NO_FD = (1 << 64) - 1


def _locked_ranges(hostpid: int) -> list[tuple[int, int, int]]:
    """(start, end, mlock2 flags) of the locked mappings, adjacent ones of one kind merged."""
    out: list[tuple[int, int, int]] = []
    start = end = 0
    with open(f"/proc/{hostpid}/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split(None, 1)[0]:
                start, end = (int(x, 16) for x in line.split(None, 1)[0].split("-"))
            elif line.startswith("VmFlags:"):
                flags = line.split()[1:]
                if "lo" not in flags or "dc" in flags:  # dc: MADV_DONTFORK, no clone has it
                    continue
                how = _MLOCK_ONFAULT if "lf" in flags else 0
                if out and out[-1][1] == start and out[-1][2] == how:
                    out[-1] = (out[-1][0], end, how)
                else:
                    out.append((start, end, how))
    return out


def plan_proc(proc) -> None:
    # smaps walks every page table: read only where something is locked
    locked_kb = int(status_of(proc).get("VmLck", "0 kB").split()[0])
    proc.locked = _locked_ranges(proc.hostpid) if locked_kb else []
    proc.lock_future = None  # mlockall flags, asked of the template on the first fork


def ask(ctx, proc, q) -> None:
    """The template's mlockall(MCL_FUTURE) flags (0: none), by the probe (see the top), once."""
    if proc.lock_future is not None:
        return

    def build(vec: int, first: int):
        mapped = Tracee.batch_ref(0)  # arg 0: the result of call `first`, the mmap
        return [
            (_SYS_MMAP, (0, _PAGE, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, _NO_FD, 0), 0),
            (_SYS_MADVISE, (first, _PAGE, mmap.MADV_DONTNEED), mapped | Tracee.BATCH_OK_ERR),
            (_SYS_MINCORE, (first, _PAGE, vec), mapped | Tracee.BATCH_OK_ERR),
            (_SYS_MUNMAP, (first, _PAGE), mapped),
        ]

    def answer(got: list[int], vec: bytes) -> None:
        if len(got) < 4 or any(-4096 < g < 0 for g in (got[0], got[2], got[3])):
            raise ForkError(f"process {proc.vpid} ({proc.name}): cannot tell whether it called "
                            f"mlockall(MCL_FUTURE) (probe results {got})", pid=proc.hostpid, step="memlock")
        if got[1] != -errno.EINVAL:
            proc.lock_future = 0
        else:
            proc.lock_future = _MCL_FUTURE | (0 if vec[0] & 1 else _MCL_ONFAULT)

    q.ask(1, build, answer)


def fixup_proc(ctx, proc, r) -> None:
    if proc.lock_future:
        r.queue("mlockall", proc.lock_future)
    for start, end, how in proc.locked:
        r.queue("mlock2", start, end - start, how)


OPS = SimpleNamespace(kind="locked-memory", plan_proc=plan_proc, ask=ask, fixup_proc=fixup_proc)
