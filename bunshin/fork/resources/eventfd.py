"""eventfd: the child gets a new eventfd with the template's counter (read from fdinfo, which
does not consume it) and flags (EFD_SEMAPHORE, EFD_NONBLOCK); one eventfd shared by several
template processes is one eventfd shared by their clones (sharing.py)."""

from __future__ import annotations

import os
import struct
from types import SimpleNamespace

from . import sharing

_EFD_SEMAPHORE = 1


def claims(proc, f) -> bool:
    return f.target == "anon_inode:[eventfd]"


def fixup(ctx, proc, r, f) -> None:
    if sharing.reuse(ctx, "eventfd", proc, r, f):
        return
    info = sharing.fdinfo(proc.hostpid, f.fd)
    count = int(info["eventfd-count"], 16)  # printed as %llx
    flags = os.O_CLOEXEC | (f.flags & os.O_NONBLOCK)
    if info.get("eventfd-semaphore", "0") != "0":
        flags |= _EFD_SEMAPHORE
    newfd = r.call("eventfd2", 0, flags)
    if count:
        # eventfd2 takes a 32-bit initial value; a write adds the full 64-bit count
        r.call("write", newfd, r.put(struct.pack("Q", count)), 8)
    r.install(newfd, f)
    sharing.remember(ctx, "eventfd", proc, f, f.fd)


OPS = SimpleNamespace(kind="eventfd", claims=claims, fixup=fixup)
