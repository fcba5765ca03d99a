"""Interval timers: fork(2) drops them, so each clone gets its template's setitimer() timers
back with the time they had left. (POSIX timers, timer_create(2), are refused until carried:
their ids must survive too.)"""

from __future__ import annotations

import struct
from types import SimpleNamespace

from ...errors import ForkError

_ITIMERS = (0, 1, 2)  # ITIMER_REAL, ITIMER_VIRTUAL, ITIMER_PROF
_ITV = struct.Struct("4q")  # it_interval, it_value as two timevals


def plan_proc(proc) -> None:
    try:
        with open(f"/proc/{proc.hostpid}/timers") as f:
            ids = [line.split()[1] for line in f if line.startswith("ID:")]
    except FileNotFoundError:
        ids = []
    if ids:
        raise ForkError(f"process {proc.vpid} ({proc.name}) has POSIX timers (ids {', '.join(ids)}): "
                        "a fork cannot carry them yet", pid=proc.hostpid, step="plan")


def fixup_proc(ctx, proc, r) -> None:
    src = ctx.shared["tracees"][proc.hostpid]
    scratch = src.mmap(4096)
    try:
        for which in _ITIMERS:
            if src.syscall(36, which, scratch) != 0:  # getitimer, in the template
                continue
            raw = src.read(scratch, _ITV.size)
            if any(_ITV.unpack(raw)):
                r.call("setitimer", which, r.put(raw), 0)
    finally:
        src.munmap(scratch, 4096)


OPS = SimpleNamespace(kind="itimers", plan_proc=plan_proc, fixup_proc=fixup_proc)
