"""Root filesystems for workspaces: turn what the user passed into overlay lower layers.

``resolve(spec)`` is the one entry point ``Workspace.create`` calls:

* ``None`` — the host's system, read-only, with private empty home/tmp/run (:mod:`.default`);
* ``"debian:<suite>"`` — a minimal Debian root built once with mmdebstrap (:mod:`.debian`);
* a directory — used as is if it looks like a root (:mod:`.directory`), or, if it holds
  ``oci-layout`` and ``index.json``, an OCI image layout whose layers are extracted (:mod:`.oci`);
* a tar file (plain, gzip, xz, bzip2, zstd) — a root filesystem tarball, a ``docker save``
  archive or an OCI archive, extracted once into the cache (:mod:`.tar`).

Layers live in ``<cache>/layers/<sha256>/``, shared by every workspace and every image.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ...errors import RootfsError
from .debian import build_debian
from .default import default_rootfs
from .directory import directory_rootfs
from .model import KINDS, Rootfs
from .oci import is_oci_layout
from .tar import archive_rootfs, image_rootfs

__all__ = ["KINDS", "Rootfs", "build_debian", "resolve"]

_DEBIAN = "debian:"


def resolve(spec: str | os.PathLike[str] | None) -> Rootfs:
    """Turn a rootfs spec into overlay lower layers (see the module docstring for the forms)."""
    if spec is None:
        return default_rootfs()
    if isinstance(spec, str) and spec.startswith(_DEBIAN):
        return Rootfs(lowers=(build_debian(spec[len(_DEBIAN) :]),), kind="debian", source=spec)
    if not isinstance(spec, (str, os.PathLike)):
        raise RootfsError(
            f"rootfs must be None, a path or 'debian:<suite>', not {type(spec).__name__}; "
            f"pass e.g. rootfs='/srv/roots/bookworm'"
        )
    source = os.fspath(spec)
    if not source:
        raise RootfsError("rootfs is an empty string; pass None for the default root or a path")
    path = Path(source).expanduser()
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise RootfsError(
            f"rootfs {source!r} does not exist; pass a root directory, a tar archive, "
            f"an OCI layout, 'debian:<suite>' or None"
        ) from None
    except OSError as e:
        raise RootfsError(f"cannot access rootfs {source!r}: {e.strerror}") from e
    if stat.S_ISDIR(st.st_mode):
        if is_oci_layout(path):
            return image_rootfs(path.resolve(), "oci", source)
        return directory_rootfs(path, source)
    if stat.S_ISREG(st.st_mode):
        return archive_rootfs(path, source)
    raise RootfsError(
        f"rootfs {source!r} is neither a directory nor a regular file; pass a directory or a tar archive"
    )
