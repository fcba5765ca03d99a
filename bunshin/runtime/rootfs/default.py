"""The embedded default root: a read-only view of the host's own system.

Only the system trees are shown (``EXPOSED``); every other top-level entry of the host root
is whited out. Home, temporary and runtime directories are shown empty (``PRIVATE``), and so
are the mount points the init fills (``MOUNT_POINTS``), so nothing of the host's users or of
other workspaces leaks in. Bunshin's own state and cache directories are masked too when
they lie inside an exposed tree (``/var/lib/bunshin`` by default). The host's top level is
read at resolve time; entries created on the host later are not hidden.
"""

from __future__ import annotations

import os
from pathlib import Path

from ... import config
from ...errors import RootfsError
from .model import Rootfs

__all__ = ["EXPOSED", "MOUNT_POINTS", "PRIVATE", "default_rootfs"]

EXPOSED = ("bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "opt", "var")
MOUNT_POINTS = ("/proc", "/sys", "/dev")
PRIVATE = ("/root", "/home", "/tmp", "/var/tmp", "/run", "/mnt", "/media", "/srv")

_HOST = Path("/")


def _bunshin_dirs(mask: list[str]) -> list[str]:
    """State and cache directories that would otherwise be visible through an exposed tree."""
    out: list[str] = []
    for d in (config.state_dir(), config.cache_dir()):
        real = os.path.realpath(d)
        parts = real.strip("/").split("/")
        if not parts[0] or parts[0] not in EXPOSED:
            continue  # "/" itself, or under a hidden or private top-level entry
        if any(real == m or real.startswith(m + "/") for m in mask + out):
            continue
        out.append(real)
    return out


def default_rootfs() -> Rootfs:
    """The host system, read-only, with private empty home, tmp and run directories."""
    if not os.path.lexists("/bin/sh"):
        raise RootfsError("the host has no /bin/sh, so the default rootfs cannot run commands; pass a rootfs")
    top = os.listdir(_HOST)
    private_top = {p[1:] for p in PRIVATE + MOUNT_POINTS if p.count("/") == 1}
    hide = sorted("/" + name for name in top if name not in EXPOSED and name not in private_top)
    mask = list(MOUNT_POINTS + PRIVATE)
    mask += _bunshin_dirs(mask)
    return Rootfs(
        lowers=(_HOST,), kind="default", source="<host>", hide=tuple(hide), mask=tuple(sorted(mask))
    )
