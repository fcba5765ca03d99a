"""eventfd: the child gets a new eventfd with the template's counter (read from fdinfo, which
does not consume it) and flags (EFD_SEMAPHORE, EFD_NONBLOCK); one eventfd shared by several
template processes is one eventfd shared by their clones (sharing.py). fdinfo shows
EFD_SEMAPHORE only since Linux 6.6; before, the eventfd is asked (:func:`is_semaphore`)."""

from __future__ import annotations

import os
import struct
from types import SimpleNamespace

from . import sharing

_EFD_SEMAPHORE = 1


def claims(proc, f) -> bool:
    return f.target == "anon_inode:[eventfd]"


def is_semaphore(hostpid: int, fd: int, count: int) -> bool:
    """Whether eventfd ``fd`` of stopped process ``hostpid`` has EFD_SEMAPHORE, asked of the
    eventfd itself, for kernels whose fdinfo does not say (before 6.6): a read takes 1 from a
    semaphore and the whole count from a plain one. The count (``count``, from fdinfo) is
    raised to 2 first if lower, so neither the read nor the test can be fooled or block, and
    put back after; the template's processes are stopped, so none of them sees it move."""
    dup = sharing.getfd_here(hostpid, fd)
    try:
        if count < 2:
            os.eventfd_write(dup, 2 - count)
        got = os.eventfd_read(dup)
        now = max(count, 2) - got
        for _ in range(now - count):  # a semaphore raised from 0: one more to take
            os.eventfd_read(dup)
        if now < count:
            os.eventfd_write(dup, count - now)
        return got == 1
    finally:
        os.close(dup)


def fixup(ctx, proc, r, f) -> None:
    if sharing.reuse(ctx, "eventfd", proc, r, f):
        return
    info = sharing.fdinfo(proc.hostpid, f.fd)
    count = int(info["eventfd-count"], 16)  # printed as %llx
    flags = os.O_CLOEXEC | (f.flags & os.O_NONBLOCK)
    sem = info.get("eventfd-semaphore")
    if sem is None:  # before Linux 6.6
        sem = "1" if is_semaphore(proc.hostpid, f.fd, count) else "0"
    if sem != "0":
        flags |= _EFD_SEMAPHORE
    newfd = r.call("eventfd2", 0, flags)
    if count:
        # eventfd2 takes a 32-bit initial value; a write adds the full 64-bit count
        r.call("write", newfd, r.put(struct.pack("Q", count)), 8)
    r.install(newfd, f)
    sharing.remember(ctx, "eventfd", proc, f, f.fd)


OPS = SimpleNamespace(kind="eventfd", claims=claims, fixup=fixup)
