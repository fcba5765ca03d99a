"""Disk quotas: what each workspace may write, and what the state image may take of the host.

Each workspace's upper layer is a btrfs subvolume (runtime/layers.py) and btrfs keeps a
*qgroup* per subvolume; its limit bounds what the workspace writes (``disk_limit``): a write
past it fails with ``EDQUOT`` inside the workspace, while the trainer's files and other
workspaces, in other subvolumes, go on. Bunshin turns on *simple quotas* (squota, kernel
>= 6.7) on the image it mounts: an extent is charged to the subvolume that wrote it, once,
when it is written, so a snapshot (every ``ws.fork()``) costs no accounting, and a fork's
child, stacked on a snapshot of its source, is charged only for what it writes after the
fork (its copy-ups are reflinks of the source's extents, charged to the source). Data its
source wrote stays charged to the source while a snapshot holds it. Full qgroups (all a
kernel < 6.7 offers) account every shared extent at each snapshot: a snapshot took ~22 ms
with them here, against ~1.5 ms without quotas or with squota; there no quota is enabled,
and ``bunshin doctor`` says so. Every workspace's layer is also in one qgroup of all
workspaces (:func:`bound_all`), so that together they leave the trainer room.

The image is sparse, so what its file system reports as free is not what the host has: at
mount the file system is sized to what it holds plus the host's free space less a reserve
(:func:`fit_image`), so that filling it stops inside the image, with ENOSPC, and never fills
the host's disk (which would leave the loop device failing writes under the file system).
"""

from __future__ import annotations

import errno
import logging
import os
import struct
from pathlib import Path

from .. import config
from ..errors import OutOfResources
from .layers import FIRST_FREE_OBJECTID, NOT_BTRFS, ioctl, ioctl_in, vol_args

__all__ = ["all_full", "bound_all", "enable", "fit_image", "limit", "mode", "note_mode", "parse_disk",
           "supported"]

log = logging.getLogger("bunshin.quota")

# linux/btrfs.h
_IOC_QUOTA_CTL = 0xC0109428  # _IOWR(0x94, 40, struct btrfs_ioctl_quota_ctl_args {u64 cmd, status})
_IOC_QGROUP_LIMIT = 0x8030942B  # _IOR(0x94, 43, {u64 qgroupid; struct btrfs_qgroup_limit})
_IOC_RESIZE = 0x50009403  # _IOW(0x94, 3, struct btrfs_ioctl_vol_args)
_IOC_FS_INFO = 0x8400941F  # _IOR(0x94, 31, struct btrfs_ioctl_fs_info_args), 1024 bytes
_IOC_QGROUP_CREATE = 0x4010942A  # _IOW(0x94, 42, {u64 create; u64 qgroupid})
_IOC_QGROUP_ASSIGN = 0x40189429  # _IOW(0x94, 41, {u64 assign; u64 src; u64 dst})
_IOC_INO_LOOKUP = 0xD0009412  # _IOWR(0x94, 18, {u64 treeid; u64 objectid; char name[4080]})
_QUOTA_CTL_ENABLE_SIMPLE_QUOTA = 4
# squota charges each extent once, so its referenced and exclusive counts are one number;
# with full qgroups (a file system of the user's own) exclusive is what no snapshot shares:
# what the workspace wrote since its last fork
_LIMIT_MAX_EXCL = 1 << 1

# qgroup 1/0 holds every workspace's layer: together they stop short of filling the state
# file system, which keeps room for the trainer's own files (meta files, logs, new workspaces)
_ALL = 1 << 48
_CHUNKS_RESERVE = 3 << 29  # 1.5 GiB
# what the host's file system keeps free of the image: 5% of it, at least 1 GiB
_HOST_RESERVE_FRACTION = 0.05
_HOST_RESERVE_MIN = 1 << 30
# the image is not shrunk below this (nor grown past its file's size): a btrfs this small
# has little room left beside its chunks
_IMAGE_MIN = 1 << 30
# the host's free space changes all the time: the image grows to follow it only past this
_GROW_MARGIN = 1 << 30

_warned: set[str] = set()
# per state file system (its path), whether it has quotas, known from its mount on
# (note_mode, enable): where it has none, limit() makes no ioctl, each of which would fail
_on: dict[str, bool] = {}


def _warn_once(key: str, msg: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


def supported() -> bool:
    """Whether this kernel's btrfs has simple quotas."""
    return os.path.exists("/sys/fs/btrfs/features/simple_quota")


def parse_disk(value: object) -> int | None:
    """``disk_limit`` in bytes, or None for no limit. ``value``: None for ``BUNSHIN_DISK_LIMIT``,
    0 (or ``"0"``) for no limit, bytes as an int, or a size as ``memory_limit`` takes it (``"4G"``)."""
    from .cgroup.limits import parse_memory

    if value is None:
        value = config.disk_limit()
        if value == "":
            return None
    if value in (0, "0"):
        return None
    # None is the default limit here, not none
    return parse_memory(value, arg="disk_limit", no_limit="0")


def enable(state: Path) -> bool:
    """Turn simple quotas on in the state file system Bunshin mounted (also one an older
    version made without them); a no-op where quotas are on. False where they cannot be."""
    _on[str(state)] = on = _enable(state)
    return on


def _enable(state: Path) -> bool:
    if not supported():
        _warn_once("squota", "this kernel's btrfs has no simple quotas (Linux >= 6.7): disk_limit is "
                   "not enforced, a workspace can fill the state file system %s", state)
        return False
    try:
        ioctl_in(state, _IOC_QUOTA_CTL, bytearray(struct.pack("=QQ", _QUOTA_CTL_ENABLE_SIMPLE_QUOTA, 0)))
        try:
            ioctl_in(state, _IOC_QGROUP_CREATE, bytearray(struct.pack("=QQ", 1, _ALL)))
        except FileExistsError:
            pass
    except OSError as e:
        _warn_once("squota", "cannot turn btrfs simple quotas on in %s (%s): disk_limit is not "
                   "enforced", state, e)
        return False
    return True


def _trainer_reserve(state: Path) -> tuple[int, int]:
    """The state file system's size, and what of it workspaces together leave the trainer:
    5%, and at least what btrfs allocates ahead of its data as that fills (chunks of up to 1
    GiB; ~20% of the data written at full speed here), or half a small file system: else its
    metadata finds no room left, and neither the trainer's files nor a deletion can be written."""
    st = os.statvfs(state)
    size = st.f_blocks * st.f_frsize
    return size, max(int(size * 0.05), min(_CHUNKS_RESERVE, size // 2))


def bound_all(state: Path) -> None:
    """Bound what every workspace writes together to the state file system's size less the
    trainer's reserve (after :func:`enable` and :func:`fit_image`)."""
    size, reserve = _trainer_reserve(state)
    most = size - reserve
    try:
        ioctl_in(state, _IOC_QGROUP_LIMIT, bytearray(struct.pack("=6Q", _ALL, _LIMIT_MAX_EXCL, 0, max(most, 0), 0, 0)))
    except OSError as e:
        log.warning("cannot bound the workspaces of %s together: %s", state, e)


def limit(layer: Path, nbytes: int | None) -> None:
    """Bound what is written in ``layer`` (a subvolume, runtime/layers.py) to ``nbytes`` (None:
    no bound of its own), and count it among all workspaces' (:func:`bound_all`). Where the
    state file system has no quotas (not btrfs, an old kernel, one of the user's own without
    them) nothing is bounded, said once."""
    state = config.state_dir()
    if not _on.get(str(state), True):
        if nbytes is not None:
            _warn_once("squota", "the state file system %s has no quotas: disk_limit is not enforced", state)
        return
    fd = os.open(layer, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if nbytes is not None:
            # qgroupid 0: the qgroup of the subvolume the descriptor is in
            ioctl(fd, _IOC_QGROUP_LIMIT, bytearray(struct.pack("=6Q", 0, _LIMIT_MAX_EXCL, 0, nbytes, 0, 0)))
        args = bytearray(struct.pack("=QQ", 0, FIRST_FREE_OBJECTID) + bytes(4080))
        ioctl(fd, _IOC_INO_LOOKUP, args)  # treeid 0: that of the descriptor's subvolume
        _join_all(fd, struct.unpack_from("=Q", args)[0])
    except OSError as e:
        if e.errno not in (*NOT_BTRFS, errno.ENOTCONN):  # ENOTCONN: quotas are off
            raise
        if nbytes is not None:
            _warn_once("squota", "the state file system %s has no quotas (%s): disk_limit is not "
                       "enforced", state, os.strerror(e.errno))
    finally:
        os.close(fd)


def all_full(state: Path) -> OutOfResources:
    """The error for a new workspace's layer that cannot be made: the workspaces there have
    written all that :func:`bound_all` gives them together."""
    size, reserve = _trainer_reserve(state)
    return OutOfResources(
        f"the state file system ({state}) is full (its workspaces have written together all of "
        f"its {size >> 20} MiB but the {reserve >> 20} MiB kept for the trainer): close "
        "workspaces, or give them smaller disk_limit values")


def _join_all(fd: int, subvolume: int) -> None:
    try:
        ioctl(fd, _IOC_QGROUP_ASSIGN, bytearray(struct.pack("=QQQ", 1, subvolume, _ALL)))
    except OSError as e:
        # EINVAL: no group of all workspaces (a file system of the user's own), or quotas off
        if e.errno not in (errno.EINVAL, errno.ENOENT, errno.ENOTCONN):
            raise


def mode(state: Path) -> str | None:
    """``squota``, ``qgroup`` or ``disabled`` for a mounted btrfs; None for another file system."""
    info = bytearray(1024)
    try:
        ioctl_in(state, _IOC_FS_INFO, info)
    except OSError:
        return None
    fsid = info[16:32].hex()
    uuid = f"{fsid[:8]}-{fsid[8:12]}-{fsid[12:16]}-{fsid[16:20]}-{fsid[20:]}"
    try:
        return Path(f"/sys/fs/btrfs/{uuid}/qgroups/mode").read_text().strip()
    except OSError:
        # no qgroups directory: quotas are off (or a kernel without the mode file: full qgroups)
        return "qgroup" if os.path.isdir(f"/sys/fs/btrfs/{uuid}/qgroups") else "disabled"


def note_mode(state: Path) -> str | None:
    """:func:`mode` of the state file system just mounted, kept for :func:`limit`."""
    m = mode(state)
    _on[str(state)] = m in ("squota", "qgroup")
    return m


def fit_image(state: Path, image: Path) -> bool:
    """Size the state file system (on ``image``, mounted at ``state``) to what the image holds
    of the host's disk plus the host's free space less a reserve, at most the image's size.
    Other trainers share it live, and a shrink relocates chunks: it is resized only when larger
    than that, or smaller by more than :data:`_GROW_MARGIN`. True if it was resized."""
    host = os.statvfs(image.parent)
    st = os.stat(image)
    reserve = max(_HOST_RESERVE_MIN, int(host.f_blocks * host.f_frsize * _HOST_RESERVE_FRACTION))
    room = st.st_blocks * 512 + host.f_bavail * host.f_frsize - reserve
    size = min(st.st_size, max(_IMAGE_MIN, room)) & ~((1 << 20) - 1)
    fs = os.statvfs(state)
    now = fs.f_blocks * fs.f_frsize
    if size <= now < size + (1 << 20) or now < size <= now + _GROW_MARGIN:
        return False
    try:
        ioctl_in(state, _IOC_RESIZE, vol_args(str(size)))
    except OSError as e:
        # a shrink below what is allocated in it fails: it keeps the size it has
        log.warning("cannot size the state file system %s to %d MiB (the host's free space less "
                    "a reserve of %d MiB): %s", state, size >> 20, reserve >> 20, e)
        return False
    if size < st.st_size:
        log.info("state file system %s sized to %d MiB: the host's disk keeps %d MiB free",
                 state, size >> 20, reserve >> 20)
    return True
