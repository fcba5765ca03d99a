"""Copy-on-write copies of a workspace's upper layer.

A fork leaves its source running on its own mounts, so the children cannot take the source's
upper directory as a lower layer: they get a copy of it frozen at the fork. On btrfs (the
state file system Bunshin makes, runtime/statefs.py) a workspace's upper and work directories
sit in one subvolume, and the copy is a read-only snapshot of it: O(1) in the files, ~1 ms
here, taken while the source is frozen (the overlay keeps working across it; the work
directory must be in the same subvolume, else copy-ups and whiteouts fail with EXDEV). On
any other file system (a tmpfs or ext4 the user mounted there) the upper directory is copied
(``cp -a --reflink=auto``: reflinks on XFS, whole files elsewhere).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import shutil
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

from ..errors import BunshinError

__all__ = ["FIRST_FREE_OBJECTID", "NOT_BTRFS", "freeze", "ioctl", "ioctl_in", "is_subvolume", "make",
           "prepare_freeze", "remove", "vol_args"]

# linux/btrfs.h: struct btrfs_ioctl_vol_args (fd, name[4088]) and _v2 (fd, transid, flags,
# 4 x u64 of union, name[4040]), both 4096 bytes
_IOC_SUBVOL_CREATE = 0x5000940E
_IOC_SNAP_DESTROY = 0x5000940F
_IOC_SNAP_CREATE_V2 = 0x50009417
_SUBVOL_RDONLY = 1 << 1
FIRST_FREE_OBJECTID = 256  # the inode number of every subvolume's root directory
NOT_BTRFS = (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS)


def vol_args(name: str, fd: int = 0) -> bytearray:
    b = os.fsencode(name)
    # a mutable buffer: ioctl hands its address to the kernel (ctypes from_buffer)
    return bytearray(struct.pack("=q", fd) + b + bytes(4088 - len(b)))


def _vol_args_v2(name: str, fd: int, flags: int) -> bytearray:
    b = os.fsencode(name)
    return bytearray(struct.pack("=qQQ", fd, 0, flags) + bytes(32) + b + bytes(4040 - len(b)))


_libc = ctypes.CDLL(None, use_errno=True)
_libc.ioctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)


def ioctl_in(parent: Path, req: int, arg: bytearray) -> None:
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        ioctl(fd, req, arg)
    finally:
        os.close(fd)


def ioctl(fd: int, req: int, arg: bytearray) -> None:
    # through ctypes, which lets go of the GIL: fcntl.ioctl keeps it for a buffer over 1 KiB,
    # and a snapshot waits for a transaction commit, which other threads (the plan of the same
    # fork) would wait for too
    if _libc.ioctl(fd, req, (ctypes.c_char * len(arg)).from_buffer(arg)) < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def make(path: Path) -> None:
    """A new directory that :func:`freeze` can copy cheaply: a subvolume on btrfs."""
    try:
        ioctl_in(path.parent, _IOC_SUBVOL_CREATE, vol_args(path.name))
    except OSError as e:
        if e.errno not in NOT_BTRFS:
            raise
        path.mkdir()


def is_subvolume(path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return st.st_ino == FIRST_FREE_OBJECTID and os.stat(path.parent).st_dev != st.st_dev


def freeze(src: Path, dst: Path, upper: str = "upper") -> None:
    """``dst``: a read-only copy of the layer ``src`` as it is now (its ``upper`` directory;
    the caller keeps its writers stopped meanwhile). Nothing is left at ``dst`` on failure."""
    prepare_freeze(src, dst, upper)()


def prepare_freeze(src: Path, dst: Path, upper: str = "upper") -> Callable[[], None]:
    """:func:`freeze` in two steps: the call returned makes the copy, which must be made
    (it closes what this opened). On btrfs that call is a single ioctl, made without the GIL:
    in a thread of its own it runs beside the caller's Python code."""
    if not is_subvolume(src):
        return functools.partial(_copy_tree, src, dst, upper)
    fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECTORY)
    try:
        parent = os.open(dst.parent, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECTORY)
    except BaseException:
        os.close(fd)
        raise
    args = _vol_args_v2(dst.name, fd, _SUBVOL_RDONLY)

    def snapshot() -> None:
        try:
            ioctl(parent, _IOC_SNAP_CREATE_V2, args)
        except OSError as e:
            raise BunshinError(f"cannot snapshot the workspace's upper layer {src}: {e}") from None
        finally:
            os.close(fd)
            os.close(parent)

    return snapshot


def _copy_tree(src: Path, dst: Path, upper: str) -> None:
    try:
        dst.mkdir()
    except OSError as e:
        raise BunshinError(f"cannot copy the workspace's upper layer {src}: {e}") from None
    try:
        subprocess.run(["cp", "-a", "--reflink=auto", "--", str(src / upper), str(dst / upper)],
                       check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        remove(dst)
        why = e.stderr.decode(errors="replace").strip() if isinstance(e, subprocess.CalledProcessError) else e
        raise BunshinError(f"cannot copy the workspace's upper layer {src}: {why}") from None


def remove(path: Path) -> None:
    """Remove a layer made by :func:`make` or :func:`freeze` (a read-only snapshot cannot be
    emptied file by file: it goes whole)."""
    if is_subvolume(path):
        try:
            ioctl_in(path.parent, _IOC_SNAP_DESTROY, vol_args(path.name))
            return
        except OSError as e:
            if e.errno not in NOT_BTRFS:
                raise
    shutil.rmtree(path, ignore_errors=True)
