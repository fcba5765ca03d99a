"""Task migrations without waiting for an RCU grace period: the kernel's favordynmods.

Moving a task into a cgroup (a write to cgroup.procs) takes the global threadgroup rwsem for
writing; by default that first waits for an RCU grace period unless another migration ran
moments before. Measured here (6.18, v1): the first move of a fork that follows a pause cost
10-25 ms — three to six times the whole fork — and 0.03 ms with favordynmods. The kernel
option trades that for slightly slower fork() and exit() system-wide (readers of the rwsem take
its slow path); once any cgroup hierarchy turns it on it stays on until reboot (the kernel
says "per threadgroup rwsem mechanism can't be disabled").

Bunshin turns it on once per boot, before its first cgroup, by remounting the cgroup2
hierarchy with the option added (the unified root lives as long as the system), or, without a
cgroup2 mount, by mounting and unmounting a controller-less named v1 hierarchy with it. The
second way lasts only on kernels that keep the option once set (6.18 here; 6.1 drops it with
the hierarchy), hence the order. ``BUNSHIN_FAVOR_DYNMODS=0`` leaves the kernel alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import tempfile
from pathlib import Path

from ... import config
from . import _fs

log = logging.getLogger("bunshin.cgroup")

_MS_REMOUNT = 32
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)
MARKER = Path("/run/bunshin/favordynmods")


def wanted() -> bool:
    return config.favor_dynmods()


def _boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def active(mountinfo: str = "/proc/self/mountinfo") -> bool:
    """Is it known to be on: a cgroup mount shows it, or Bunshin turned it on this boot?"""
    try:
        if any("favordynmods" in m.options for m in _fs.cgroup_mounts(mountinfo)):
            return True
        return MARKER.read_text().strip() == _boot_id()
    except OSError:
        return False


def _mount(src: bytes | None, target: str, fstype: bytes | None, flags: int, data: bytes) -> None:
    if _libc.mount(src, target.encode(), fstype, flags, data) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), target)


def _via_v1() -> None:
    d = tempfile.mkdtemp(prefix="bunshin-dynmods-", dir="/run")
    try:
        _mount(b"cgroup", d, b"cgroup", 0, b"none,name=bunshin-dynmods,favordynmods")
        _libc.umount2(d.encode(), _MNT_DETACH)
    finally:
        os.rmdir(d)


def _via_v2() -> None:
    for m in _fs.cgroup_mounts("/proc/self/mountinfo"):
        if m.fstype == "cgroup2":
            # a remount replaces the super block's options: keep the ones it has
            keep = [o for o in sorted(m.options) if o not in ("rw", "ro")]
            _mount(None, m.point, None, _MS_REMOUNT, ",".join([*keep, "favordynmods"]).encode())
            return
    raise OSError(2, "no cgroup2 mount")


def ensure() -> bool:
    """Turn favordynmods on unless it is on or unwanted; True when it is on. Never raises:
    without it forks are slower after a pause, not wrong."""
    if not wanted():
        return False
    if active():
        return True
    errors = []
    for how in (_via_v2, _via_v1):
        try:
            how()
            break
        except OSError as e:
            errors.append(f"{how.__name__[5:]}: {e}")
    else:
        log.warning("cgroup favordynmods stays off (%s): a fork after a pause may wait ~10 ms "
                    "for an RCU grace period to move its first task", "; ".join(errors))
        return False
    try:
        MARKER.parent.mkdir(parents=True, exist_ok=True)
        MARKER.write_text(_boot_id() + "\n")
    except OSError:
        pass
    log.info("cgroup favordynmods on (until reboot): task migrations no longer wait for an RCU "
             "grace period; fork()/exit() are slightly slower system-wide. "
             "BUNSHIN_FAVOR_DYNMODS=0 leaves the kernel alone")
    return True
