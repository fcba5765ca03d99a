"""A directory on the host used as the single read-only layer of the root.

It must look like a root filesystem: an ``etc`` directory, or ``bin/sh``, or ``usr/bin``.
The check only catches a wrong path (a project checkout, an empty dir); it does not prove
that programs in it will run.
"""

from __future__ import annotations

import os
from pathlib import Path

from ...errors import RootfsError
from .model import Rootfs

__all__ = ["check_looks_like_root", "directory_rootfs", "looks_like_root"]


def looks_like_root(root: Path) -> bool:
    """True if ``root`` has ``etc/``, ``bin/sh`` (any file type, even a dangling symlink) or ``usr/bin/``."""
    return (
        os.path.isdir(os.path.join(root, "etc"))
        or os.path.lexists(os.path.join(root, "bin", "sh"))
        or os.path.isdir(os.path.join(root, "usr", "bin"))
    )


def check_looks_like_root(root: Path, source: str) -> None:
    """Raise :class:`RootfsError` unless ``root`` looks like a root filesystem."""
    if not looks_like_root(root):
        raise RootfsError(
            f"rootfs {source!r} does not look like a root filesystem (no etc/, bin/sh or usr/bin/); "
            f"point at the top of a root tree, e.g. one made by bunshin.runtime.rootfs.build_debian()"
        )


def directory_rootfs(path: Path, source: str) -> Rootfs:
    """Use an existing directory as the root's only lower layer."""
    real = Path(os.path.realpath(path))
    if not os.access(real, os.R_OK | os.X_OK):
        raise RootfsError(f"rootfs directory {source!r} is not readable; fix its permissions")
    check_looks_like_root(real, source)
    return Rootfs(lowers=(real,), kind="directory", source=source)
