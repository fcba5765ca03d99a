"""Pipes and FIFOs: the child gets a new pipe (or reopens its own FIFO) holding a copy of the
bytes buffered in the template's, copied with tee(2), which leaves the template's untouched.

A pipe is created in the first clone that holds it; later clones open it through that
clone's /proc/PID/fd entry, which yields the same pipe. A pipe with only one end inside had its
other end closed (the workspace refuses to fork while a tool call's pipes lead to the trainer),
so the copy is closed on that side too: readers still get the bytes, then EOF.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from types import SimpleNamespace


_libc = ctypes.CDLL(None, use_errno=True)
_libc.tee.restype = ctypes.c_ssize_t
_libc.tee.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint]
_SPLICE_F_NONBLOCK = 2


def claims(proc, f) -> bool:
    return f.target.startswith("pipe:") or stat.S_ISFIFO(f.mode)


def _access(f) -> int:
    return f.flags & os.O_ACCMODE


def _copy_buffer(src_path: str, dst_path: str) -> None:
    src = os.open(src_path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        dst = os.open(dst_path, os.O_WRONLY | os.O_NONBLOCK)
        try:
            if _libc.tee(src, dst, 1 << 20, _SPLICE_F_NONBLOCK) < 0:
                e = ctypes.get_errno()
                if e != errno.EAGAIN:  # EAGAIN: nothing buffered
                    raise OSError(e, os.strerror(e))
        finally:
            os.close(dst)
    finally:
        os.close(src)


def fixup(ctx, proc, r, f) -> None:
    made = ctx.shared.setdefault("pipes", {})
    key = (f.dev, f.ino)
    if key in made:
        vpid, fd = made[key]
        newfd = r.queue_openat(f"/proc/{vpid}/fd/{fd}", _access(f) | os.O_NONBLOCK)
    elif f.target.startswith("pipe:"):
        rd, wr = r.pipe()
        _copy_buffer(f"/proc/{proc.hostpid}/fd/{f.fd}", f"/proc/{r.t.pid}/fd/{wr}")
        keep, drop = (rd, wr) if _access(f) == os.O_RDONLY else (wr, rd)
        r.queue("close", drop)
        newfd = keep
        made[key] = (proc.vpid, f.fd)
    else:  # a named FIFO: the child's own, at the same path in its own root
        newfd = r.openat(f.target, _access(f) | os.O_NONBLOCK)
        _copy_buffer(f"/proc/{proc.hostpid}/fd/{f.fd}", f"/proc/{r.t.pid}/fd/{newfd}")
        made[key] = (proc.vpid, f.fd)
    r.queue("fcntl", newfd, 4, f.flags & (os.O_NONBLOCK | os.O_APPEND))  # F_SETFL: original flags
    r.install(newfd, f)


OPS = SimpleNamespace(kind="pipe", claims=claims, fixup=fixup)
