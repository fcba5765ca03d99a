"""Pipes and FIFOs: the child gets a new pipe (or reopens its own FIFO) of the template's size
(F_SETPIPE_SZ) holding a copy of the bytes buffered in the template's, copied with tee(2), which
leaves the template's untouched. tee copies only what fits in one call (a second would copy the
same bytes again), so the new pipe gets the template's size first: it then has as many slots.

A pipe is created in the first clone that holds it; later clones open it through that
clone's /proc/PID/fd entry, which yields the same pipe. A pipe with only one end inside had its
other end closed (the workspace refuses to fork while a tool call's pipes lead to the trainer),
so the copy is closed on that side too: readers still get the bytes, then EOF.

A FIFO is opened while the clone holds it open for reading and writing too, so that no open
waits or fails for want of a peer (a write-only one alone); an unlinked FIFO is made again at
its path, opened and unlinked (by the trainer, in the child's root, for a clone that may not
make it there: sharing.by_trainer).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import stat
import struct
import termios
from types import SimpleNamespace

from ...errors import ForkError
from ...runtime.userns import owner_inside
from . import sharing
from .files_reg import drop_way, in_childs_root, make_way, way_to

_DELETED = " (deleted)"
_AT_FDCWD = -100 & 0xFFFFFFFFFFFFFFFF
_O_DIRECT = 0o40000


_libc = ctypes.CDLL(None, use_errno=True)
_libc.tee.restype = ctypes.c_ssize_t
_libc.tee.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint]
_SPLICE_F_NONBLOCK = 2
_F_SETPIPE_SZ, _F_GETPIPE_SZ = 1031, 1032


def claims(proc, f) -> bool:
    return not f.flags & os.O_PATH and (f.target.startswith("pipe:") or stat.S_ISFIFO(f.mode))


def check_tree(procs) -> None:
    """Refuse, at plan time, an unlinked FIFO that cannot be made again at its path, and a
    packet-mode pipe end (O_DIRECT), which an open of it again cannot give."""
    root = f"/proc/{procs[0].hostpid}/root"
    for p in procs:
        for f in p.fds:
            if f.handler is OPS and f.flags & _O_DIRECT:
                raise ForkError(f"process {p.vpid} ({p.name}) fd {f.fd} is a packet-mode pipe end (O_DIRECT, "
                                f"{f.target}): a fork cannot make one again", pid=p.hostpid, step="plan")
            if f.handler is not OPS or f.dup_of is not None or not f.target.endswith(_DELETED):
                continue
            f.way, why = way_to(root, f.target)
            if f.way is None:
                raise ForkError(f"process {p.vpid} ({p.name}) fd {f.fd} is an unlinked fifo ({f.target}): {why}",
                                pid=p.hostpid, step="plan")


def _access(f) -> int:
    return f.flags & os.O_ACCMODE


def _copy_buffer(proc, f, src_path: str, dst_path: str) -> None:
    """The template pipe's size and buffered bytes given to the (empty) new one. The trainer
    sets the size (root: past fs.pipe-max-size, as a process may have gone). The template's
    end is read through its own open file (pidfd_getfd); a reader of it is opened only for
    bytes queued behind a write-only end: an open of a FIFO counts as a peer, which would let
    a process of the template blocked opening it go on without one."""
    held = sharing.getfd_here(proc.hostpid, f.fd)
    src = -1
    try:
        size, queued = fcntl.fcntl(held, _F_GETPIPE_SZ), _queued(held)
        if queued:
            src = held if _access(f) != os.O_WRONLY else os.open(src_path, os.O_RDONLY | os.O_NONBLOCK)
        dst = os.open(dst_path, os.O_WRONLY | os.O_NONBLOCK)
        try:
            if fcntl.fcntl(dst, _F_GETPIPE_SZ) != size:
                fcntl.fcntl(dst, _F_SETPIPE_SZ, size)
            if queued and _libc.tee(src, dst, queued, _SPLICE_F_NONBLOCK) < 0:
                e = ctypes.get_errno()
                raise OSError(e, os.strerror(e))
            if _queued(dst) != queued:
                raise ForkError(f"process {proc.vpid} ({proc.name}) fd {f.fd}: {_queued(dst)} of the {queued} "
                                f"bytes buffered in its {f.target} copied", pid=proc.hostpid, step="fixup")
        finally:
            os.close(dst)
    finally:
        if src not in (-1, held):
            os.close(src)
        os.close(held)


def _queued(fd: int) -> int:
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]


def fixup(ctx, proc, r, f) -> None:
    if sharing.take_shared(proc, r, f):  # another process's open file: its O_NONBLOCK is this one's
        return
    made = ctx.shared.setdefault("pipes", {})
    key = (f.dev, f.ino)
    if key in made:
        vpid, fd = made[key]
        newfd = _open_fifo(r, proc, f"/proc/{vpid}/fd/{fd}", f) if stat.S_ISFIFO(f.mode) else \
            sharing.queue_open(r, proc, f"/proc/{vpid}/fd/{fd}", _access(f) | os.O_NONBLOCK)
    elif f.target.startswith("pipe:"):
        rd, wr = r.pipe()
        _copy_buffer(proc, f, f"/proc/{proc.hostpid}/fd/{f.fd}", f"/proc/{r.t.pid}/fd/{wr}")
        if _access(f) == os.O_RDWR:  # an end opened again through /proc both ways: so is its copy
            newfd = sharing.queue_open(r, proc, f"/proc/self/fd/{rd}", os.O_RDWR | os.O_NONBLOCK)
            r.queue("close", rd)
            r.queue("close", wr)
        else:
            keep, drop = (rd, wr) if _access(f) == os.O_RDONLY else (wr, rd)
            r.queue("close", drop)
            newfd = keep
        made[key] = (proc.vpid, f.fd)
    else:  # a named FIFO: the child's own, at the same path in its own root
        path = f.target.removesuffix(_DELETED)
        if not f.target.endswith(_DELETED):
            newfd = _open_named_fifo(r, proc, path, f)
        elif sharing.by_trainer(proc):  # a clone that may not make it there: the trainer does
            newfd = _remake_fifo_by_trainer(r, proc, path, f)
        else:  # plan: the name is free
            st = os.stat(f"/proc/{proc.hostpid}/fd/{f.fd}")
            make_way(r, f.way)
            r.queue("mknodat", _AT_FDCWD, r.queue_path(path), stat.S_IFIFO | 0o600, 0)
            r.queue("fchownat", _AT_FDCWD, r.queue_path(path), *owner_inside(r.t.pid, st), 0)
            r.queue("fchmodat", _AT_FDCWD, r.queue_path(path), stat.S_IMODE(st.st_mode))
            newfd = _open_named_fifo(r, proc, path, f)
            r.queue("unlinkat", _AT_FDCWD, r.queue_path(path), 0)
            drop_way(r, f.way)
        made[key] = (proc.vpid, f.fd)
    r.queue("fcntl", newfd, 4, f.flags & (os.O_NONBLOCK | os.O_APPEND))  # F_SETFL: original flags
    r.install(newfd, f)


def _open_named_fifo(r, proc, path: str, f):
    """The child's FIFO at ``path`` opened as ``f`` was, holding a copy of its bytes."""
    return _open_fifo(r, proc, path, f, lambda helper: _copy_buffer(
        proc, f, f"/proc/{proc.hostpid}/fd/{f.fd}", f"/proc/{r.t.pid}/fd/{sharing.number(helper)}"))


def _remake_fifo_by_trainer(r, proc, path: str, f):
    """An unlinked FIFO made again at ``path`` by the trainer in the child's root, opened for
    the clone and unlinked."""
    st = os.stat(f"/proc/{proc.hostpid}/fd/{f.fd}")
    with in_childs_root(proc, r, f"fd {f.fd}: unlinked fifo {f.target}", path, f.way) as (parent, name):
        os.mkfifo(name, 0o600, dir_fd=parent)
        try:
            os.chown(name, st.st_uid, st.st_gid, dir_fd=parent)
            os.chmod(name, stat.S_IMODE(st.st_mode), dir_fd=parent)
            return _open_named_fifo(r, proc, path, f)  # the trainer's opens: done by now
        finally:
            os.unlink(name, dir_fd=parent)


def _open_fifo(r, proc, path: str, f, fill=None):
    """``path`` opened as ``f`` was, while a read-write helper is its peer (given to ``fill``)."""
    helper = sharing.queue_open(r, proc, path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    if fill is not None:
        fill(helper)
    newfd = sharing.queue_open(r, proc, path, _access(f) | os.O_NONBLOCK)
    r.queue("close", helper)
    return newfd


OPS = SimpleNamespace(kind="pipe", claims=claims, fixup=fixup, check_tree=check_tree)
