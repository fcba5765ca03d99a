"""Descriptors that cannot be reopened through /proc/PID/fd (eventfd, timerfd, epoll, sockets):
the first clone that holds one creates the child's copy; later clones take that copy out of the
earlier clone with pidfd_getfd(2). Clones of one child share its pid namespace and stay stopped
until the child is whole, so the earlier clone's pid there (its vpid) names it.

Used by the resource modules, not an ops table itself.
"""

from __future__ import annotations

import ctypes
import os

from ..._core._syscalls import KCMP_FILE, kcmp

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_SYS_PIDFD_GETFD = 438


def _made(ctx, kind: str) -> list:
    return ctx.shared.setdefault(f"made-{kind}", [])


def find(ctx, kind: str, proc, f) -> tuple[int, int] | None:
    """(vpid, fd) of the child's copy of ``f``'s open file, if an earlier clone made it. The
    template's files are compared with kcmp: anonymous inodes all share one inode number."""
    for hostpid, fd, where in _made(ctx, kind):
        try:
            if kcmp(proc.hostpid, hostpid, KCMP_FILE, f.fd, fd) == 0:
                return where
        except OSError:
            pass
    return None


def reuse(ctx, kind: str, proc, r, f) -> bool:
    """Install the copy an earlier clone made of ``f``'s open file, if there is one."""
    where = find(ctx, kind, proc, f)
    if where is None:
        return False
    r.install(grab(r, where), f)
    return True


def remember(ctx, kind: str, proc, f, fd: int) -> None:
    """``fd`` in this clone is the child's copy of template file ``f``."""
    _made(ctx, kind).append((proc.hostpid, f.fd, (proc.vpid, fd)))


def grab(r, where: tuple[int, int]) -> int:
    """A descriptor, in the clone behind ``r``, for descriptor ``where`` of an earlier clone."""
    vpid, fd = where
    pidfd = r.call("pidfd_open", vpid, 0)
    try:
        return r.call("pidfd_getfd", pidfd, fd, 0)
    finally:
        r.call("close", pidfd)


def getfd_here(hostpid: int, fd: int) -> int:
    """A copy, in the trainer, of descriptor ``fd`` of host process ``hostpid`` (stopped or
    frozen): to read a template socket's queue or fill a clone's, without injecting."""
    pidfd = os.pidfd_open(hostpid)
    try:
        got = _libc.syscall(ctypes.c_long(_SYS_PIDFD_GETFD), ctypes.c_long(pidfd), ctypes.c_long(fd), ctypes.c_long(0))
        if got < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"pidfd_getfd({hostpid}, {fd}): {os.strerror(e)}")
        return got
    finally:
        os.close(pidfd)


def fdinfo(hostpid: int, fd: int) -> dict[str, str]:
    with open(f"/proc/{hostpid}/fdinfo/{fd}") as fh:
        return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in fh) if v}
