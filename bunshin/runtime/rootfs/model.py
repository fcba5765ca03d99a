"""The resolved rootfs: overlay lower layers plus what to hide or empty in a fresh upper."""

from __future__ import annotations

import errno
import os
import posixpath
import stat
from dataclasses import dataclass
from pathlib import Path

from ...errors import RootfsError
from .image_config import ImageConfig

__all__ = ["KINDS", "Rootfs"]

KINDS = ("default", "directory", "tar", "oci", "docker-archive", "debian", "fork")

# ':' separates lowerdir entries and ',' separates mount options; the init joins lowers
# verbatim, so a path holding either would be split in the wrong place.
_FORBIDDEN_IN_LOWER = (":", ",", "\n")

_OPAQUE_XATTR = "trusted.overlay.opaque"


def _in_root_path(path: str, what: str) -> str:
    if not isinstance(path, str) or not path.startswith("/"):
        raise RootfsError(f"{what} path {path!r} must be an absolute path inside the root, like '/srv'")
    norm = posixpath.normpath(path)
    if norm != path or norm in ("/", "//") or "/../" in f"{norm}/":
        raise RootfsError(
            f"{what} path {path!r} must be normalised (no '..', '.', '//' or trailing '/') "
            f"and must not be '/' itself"
        )
    return norm


@dataclass(frozen=True)
class Rootfs:
    """A workspace root: read-only overlay lower layers and edits for the workspace's upper.

    ``lowers`` are absolute directories, topmost first, ready to join with ``:`` into the
    overlay ``lowerdir=`` option. ``hide`` lists in-root paths that the workspace must not
    see (an overlay whiteout in the upper); ``mask`` lists in-root directories shown empty
    (an opaque directory in the upper, private to the workspace and writable).
    ``image``: the environment, working directory, user and command the image's config names.
    """

    lowers: tuple[Path, ...]
    kind: str
    source: str
    hide: tuple[str, ...] = ()
    mask: tuple[str, ...] = ()
    #: an image's own settings (OCI/docker config); None for a root that is not an image
    image: ImageConfig | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RootfsError(f"rootfs kind {self.kind!r} is unknown; use one of {', '.join(KINDS)}")
        if not self.lowers:
            raise RootfsError(f"rootfs {self.source!r} has no layers; an image needs at least one")
        lowers = tuple(Path(p) for p in self.lowers)
        for lower in lowers:
            if not lower.is_absolute() or not lower.is_dir():
                raise RootfsError(
                    f"rootfs layer {str(lower)!r} (from {self.source!r}) is not an existing "
                    f"absolute directory; resolve the rootfs again"
                )
            bad = [c for c in _FORBIDDEN_IN_LOWER if c in str(lower)]
            if bad:
                raise RootfsError(
                    f"rootfs layer path {str(lower)!r} contains {bad[0]!r}, which overlayfs "
                    f"cannot take in lowerdir=; move it (or BUNSHIN_CACHE_DIR) to a plain path"
                )
        hide = tuple(_in_root_path(p, "hidden") for p in self.hide)
        mask = tuple(_in_root_path(p, "masked") for p in self.mask)
        for h in hide:
            clash = [m for m in mask if m == h or m.startswith(h + "/")]
            if clash:
                raise RootfsError(
                    f"path {clash[0]!r} is masked but {h!r} is hidden; a hidden path cannot "
                    f"also be shown empty, drop one of them"
                )
        object.__setattr__(self, "lowers", lowers)
        object.__setattr__(self, "hide", hide)
        object.__setattr__(self, "mask", mask)

    @property
    def lowerdir(self) -> str:
        """The overlay ``lowerdir=`` value: the lowers joined by ``:``, topmost first."""
        return ":".join(str(p) for p in self.lowers)

    def prepare_upper(self, upper: Path) -> None:
        """Write this rootfs's whiteouts and opaque directories into a fresh upper directory.

        Directories created on the way copy owner, mode and mtime from the lowers, because
        overlayfs shows a merged directory with the upper's attributes. Needs root (mknod,
        trusted xattrs). Running it twice on the same upper is harmless.
        """
        upper = Path(upper)
        if not upper.is_dir():
            raise RootfsError(f"upper directory {str(upper)!r} does not exist; create it first")
        _copy_attrs(self._lower_stat(""), str(upper))
        created: list[tuple[str, os.stat_result | None]] = []
        try:
            for path in sorted(self.hide):
                self._make_parents(upper, path, created)
                target = os.path.join(upper, path[1:])
                if not os.path.lexists(target):
                    os.mknod(target, stat.S_IFCHR | 0o000, os.makedev(0, 0))
            for path in sorted(self.mask):
                self._make_parents(upper, path, created)
                target = os.path.join(upper, path[1:])
                st = os.lstat(target) if os.path.lexists(target) else None
                if st is not None and not stat.S_ISDIR(st.st_mode):
                    os.unlink(target)
                    st = None
                if st is None:
                    os.mkdir(target)
                    lower = self._lower_stat(path[1:])
                    dir_like = lower is not None and stat.S_ISDIR(lower.st_mode)
                    created.append((target, lower if dir_like else None))
                os.setxattr(target, _OPAQUE_XATTR, b"y", follow_symlinks=False)
        except PermissionError as e:
            raise RootfsError(
                f"cannot write whiteouts into {str(upper)!r} ({e.strerror}); preparing an "
                f"overlay upper needs root (CAP_SYS_ADMIN, CAP_MKNOD)"
            ) from e
        except OSError as e:
            if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
                raise RootfsError(
                    f"the filesystem of {str(upper)!r} does not support trusted xattrs; put "
                    f"BUNSHIN_STATE_DIR on ext4, xfs, btrfs or tmpfs"
                ) from e
            raise
        # Deepest first, so that creating a child does not bump its parent's restored mtime.
        for target, lower in sorted(created, key=lambda c: c[0], reverse=True):
            _copy_attrs(lower, target)

    def _lower_stat(self, rel: str) -> os.stat_result | None:
        """lstat of ``rel`` in the topmost lower that has it (whiteouts are not followed)."""
        for lower in self.lowers:
            try:
                return os.lstat(os.path.join(lower, rel))
            except OSError:
                continue
        return None

    def _make_parents(self, upper: Path, path: str, created: list) -> None:
        parts = path[1:].split("/")[:-1]
        for i in range(len(parts)):
            rel = "/".join(parts[: i + 1])
            target = os.path.join(upper, rel)
            lower = self._lower_stat(rel)
            if lower is not None and not stat.S_ISDIR(lower.st_mode):
                raise RootfsError(
                    f"cannot hide or mask {path!r}: '/{rel}' is not a directory in rootfs "
                    f"{self.source!r} (a symlink?); name the real path instead"
                )
            if not os.path.isdir(target):
                os.mkdir(target)
                created.append((target, lower))


def _copy_attrs(st: os.stat_result | None, target: str) -> None:
    if st is None:
        os.chmod(target, 0o755)
        return
    os.chown(target, st.st_uid, st.st_gid, follow_symlinks=False)
    os.chmod(target, stat.S_IMODE(st.st_mode))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
