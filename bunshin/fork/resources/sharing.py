"""Descriptors that cannot be reopened through /proc/PID/fd (eventfd, timerfd, epoll, sockets):
the first clone that holds one creates the child's copy; later clones take that copy out of the
earlier clone with pidfd_getfd(2). Clones of one child share its pid namespace and stay stopped
until the child is whole, so the earlier clone's pid there (its vpid) names it.

A clone without the privileges its template process dropped (one under another uid: the
module's FORK forks it) may not take or reopen another process's descriptors, nor reopen what
it opened while it had them: the trainer does that for it and hands the descriptor over
(:func:`open_for`, :func:`grab`).

Used by the resource modules, not an ops table itself.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import socket
import struct

from ..._core._syscalls import KCMP_FILE, kcmp
from ...errors import ForkError

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_SYS_PIDFD_GETFD = 438
_SYS_OPENAT2 = 437
_RESOLVE_NO_MAGICLINKS, _RESOLVE_IN_ROOT = 0x02, 0x10
_O_PATH_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PROC_FD = re.compile(r"/proc/(\d+|self)/fd/(\d+)")
# what lets a process open, take or chown what is not its own: CAP_CHOWN, CAP_DAC_OVERRIDE,
# CAP_DAC_READ_SEARCH, CAP_FOWNER, CAP_SYS_PTRACE
_BYPASS_CAPS = (0, 1, 2, 3, 19)


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


def take_shared(proc, r, f) -> bool:
    """Install, for ``f``, the earlier clone's descriptor of the open file ``f`` shares with
    another process in the template (plan: shared_from), if it does: one offset and one set of
    status flags among the child's processes as among the template's. For what a resource
    reopens per process (a path, a memfd, a pipe), which would split it. Queued where the
    clone may take it itself (CAP_SYS_PTRACE: it is not by_trainer), as most stdouts are:
    no stop of its own."""
    if f.shared_from is None:
        return False
    if by_trainer(proc):
        r.install(grab(r, f.shared_from), f)
        return True
    vpid, fd = f.shared_from
    pidfd = r.queue("pidfd_open", vpid, 0)
    got = r.queue("pidfd_getfd", pidfd, fd, 0)
    r.queue("close", pidfd)
    r.install(got, f)
    return True


def grab(r, where: tuple[int, int]) -> int:
    """A descriptor, in the clone behind ``r``, for descriptor ``where`` of an earlier clone;
    taken by the trainer and handed over where the clone may not (EPERM: it runs under
    another uid, or the earlier clone does)."""
    vpid, fd = where
    pidfd = r.call("pidfd_open", vpid, 0)
    try:
        got = r.call("pidfd_getfd", pidfd, fd, 0, ok_errnos=(errno.EPERM,))
        if got >= 0:
            return got
        try:
            here = getfd_here(_host_pid(r, pidfd), fd)
        except OSError as e:
            raise ForkError(f"{r.what}: descriptor {fd} of process {vpid}, taken for it by the "
                            f"trainer: {e.strerror}", pid=r.t.pid, step="pidfd_getfd",
                            errno=e.errno) from None
    finally:
        r.call("close", pidfd)
    try:
        return hand_over(r, here)
    finally:
        os.close(here)


def by_trainer(proc) -> bool:
    """Whether the clone of ``proc`` lacks a capability that reopening its descriptors may
    need (it runs under another uid, or dropped them): the trainer opens them then
    (:func:`open_for`). Not for a transplant (fork/transplant.py): it is root until its last
    fixup."""
    if proc.transplanted:
        return False
    return any(not proc.cap_eff >> bit & 1 for bit in _BYPASS_CAPS)


def queue_open(r, proc, path: str, flags: int):
    """``path`` opened with ``flags`` for the clone of ``proc`` behind ``r``: queued in it, or
    by the trainer where the clone may not (:func:`by_trainer`). A number or a Ref."""
    return open_for(r, path, flags) if by_trainer(proc) else r.queue_openat(path, flags)


def number(fd) -> int:
    """The descriptor a queue_open gave, run if still queued."""
    return fd if isinstance(fd, int) else fd.value


def open_for(r, path: str, flags: int) -> int:
    """``path`` opened with ``flags`` by the trainer, as the clone behind ``r`` would (in its
    root, symlinks resolved there: a workspace's own cannot lead out), and handed over to it.
    /proc/VPID/fd/N, an earlier clone's descriptor (or /proc/self/fd/N, its own), is that
    clone's as the trainer names it."""
    m = _PROC_FD.fullmatch(path)
    try:
        if m is None:
            here = open_in_root(r.t.pid, path, flags)
        else:
            here = os.open(f"/proc/{_on_host(r, m[1])}/fd/{m[2]}", flags | os.O_CLOEXEC)
    except OSError as e:
        raise ForkError(f"{r.what}: {path}, opened for it by the trainer: {e.strerror}",
                        pid=r.t.pid, step="open", errno=e.errno) from None
    try:
        return hand_over(r, here)
    finally:
        os.close(here)


def open_in_root(hostpid: int, path: str, flags: int) -> int:
    """``path`` opened by the trainer as process ``hostpid`` would (in its root)."""
    if flags & os.O_PATH:  # open() ignores the others there; openat2 refuses them (EINVAL)
        flags &= _O_PATH_FLAGS
    root = os.open(f"/proc/{hostpid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        how = struct.pack("QQQ", flags | os.O_CLOEXEC, 0, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
        got = _libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_long(root), os.fsencode(path),
                            how, ctypes.c_long(len(how)))
        if got < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"{path}: {os.strerror(e)}")
        return got
    finally:
        os.close(root)


def _on_host(r, vpid: str) -> int:
    """The host pid of process ``vpid`` ("self": the clone) of the clone behind ``r``."""
    if vpid == "self":
        return r.t.pid
    pidfd = r.call("pidfd_open", int(vpid), 0)
    try:
        return _host_pid(r, pidfd)
    finally:
        r.call("close", pidfd)


def _host_pid(r, pidfd: int) -> int:
    """The host pid of the process behind ``pidfd``, a pidfd of the clone behind ``r``
    (its fdinfo, read in the trainer's pid namespace)."""
    with open(f"/proc/{r.t.pid}/fdinfo/{pidfd}") as fh:
        for line in fh:
            if line.startswith("Pid:"):
                return int(line.split()[1])
    raise OSError(errno.ESRCH, f"pidfd {pidfd} of {r.t.pid} names no process")


def hand_over(r, fd: int) -> int:
    """Descriptor ``fd`` of the trainer installed in the clone behind ``r`` (close-on-exec;
    returns its number there): sent over a socket pair the clone makes, whose one end the
    trainer takes (it may: it traces the clone)."""
    base = r.put(bytes(8))
    r.call("socketpair", socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, 0, base)
    theirs, ours = struct.unpack("ii", r.t.read(base, 8))
    try:
        with socket.socket(fileno=getfd_here(r.t.pid, ours)) as s:
            socket.send_fds(s, [b"\0"], [fd])
        try:
            _body, fds = r.t.recv_fds(theirs, 1, at=base + 8)
        except OSError as e:
            raise ForkError(f"{r.what}: a descriptor handed over by the trainer: recvmsg: {e.strerror}",
                            pid=r.t.pid, step="recvmsg", errno=e.errno) from None
        if len(fds) != 1:
            for extra in fds:
                r.call("close", extra)
            raise ForkError(f"{r.what}: a descriptor handed over by the trainer: none came",
                            pid=r.t.pid, step="recvmsg", errno=errno.EIO)
        return fds[0]
    finally:
        r.call("close", theirs)
        r.call("close", ours)


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
