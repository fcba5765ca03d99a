"""Layer tarballs: decompression, safe extraction, OCI-to-overlay whiteouts, the layer cache.

Extraction keeps everything a root filesystem needs (numeric owners, setuid bits, device
nodes, hard and symbolic links, mtimes, ``SCHILY.xattr`` extended attributes) and refuses
what could write outside the layer: ``..`` escapes, members or hard-link targets reached
through a symlink, and members that would replace a directory. Leading ``/`` is taken as
root-relative. OCI whiteouts become overlayfs ones: ``.wh.NAME`` turns into a 0:0 character
device ``NAME`` and ``.wh..wh..opq`` marks its directory ``trusted.overlay.opaque=y``.
"""

from __future__ import annotations

import bz2
import contextlib
import copy
import errno
import gzip
import hashlib
import io
import logging
import lzma
import os
import posixpath
import stat
import tarfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from ... import config
from ...errors import RootfsError
from . import store

__all__ = ["check_hex", "ensure_layer", "extract", "layers_dir", "open_tar", "sha256_file"]

log = logging.getLogger(__name__)

_CHUNK = 1 << 20
_WH = ".wh."
_OPAQUE = ".wh..wh..opq"
_XATTR_PAX = "SCHILY.xattr."
# Image-supplied overlay xattrs would let a layer forge whiteouts or redirects.
_SKIP_XATTR = ("trusted.overlay.",)

try:
    import zstandard
except ImportError:  # pragma: no cover - zstandard is a dependency, but stay usable without
    zstandard = None  # type: ignore[assignment]  # mypy has no "module or None" for an import

# Errors that mean "the bytes are not a well-formed (compressed) tar".
CORRUPT = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, gzip.BadGzipFile) + (
    (zstandard.ZstdError,) if zstandard is not None else ()
)


def layers_dir() -> Path:
    """Where extracted layers live: ``<cache>/layers/<sha256 hex>/``."""
    return config.cache_dir() / "layers"


def check_hex(digest: str, where: str) -> str:
    """The hex part of a ``sha256:`` digest, refusing other algorithms and malformed ones."""
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise RootfsError(
            f"{where}: digest {digest!r} is not a sha256 digest ('sha256:' + 64 lowercase hex); "
            f"only sha256 content addresses are supported, re-export the image"
        )
    return hexpart


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class _HashingReader(io.RawIOBase):
    """Read-through wrapper that hashes every byte read from the raw file."""

    def __init__(self, raw: io.BufferedIOBase) -> None:
        self._raw = raw
        self.hash = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        n = self._raw.readinto(buf)
        if n:
            self.hash.update(memoryview(buf)[:n])
        return n or 0

    def drain(self) -> str:
        while self.read(_CHUNK):
            pass
        return self.hash.hexdigest()


def _decompressed(raw: BinaryIO) -> BinaryIO:
    """Wrap a buffered stream in the decompressor its magic bytes name (or none)."""
    head = raw.peek(6)[:6]  # type: ignore[attr-defined]
    if head.startswith(b"\x1f\x8b"):
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    if head.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMAFile(raw)  # type: ignore[return-value]
    if head.startswith(b"BZh"):
        return bz2.BZ2File(raw)  # type: ignore[return-value]
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        if zstandard is None:
            raise RootfsError(
                "zstd-compressed archive but the 'zstandard' package is missing; pip install zstandard"
            )
        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
    return raw


@contextmanager
def open_tar(path: Path, what: str) -> Iterator[tuple[tarfile.TarFile, _HashingReader]]:
    """Open a possibly compressed tar for one streaming pass; also yields the byte hasher."""
    with contextlib.ExitStack() as stack:
        try:
            f = stack.enter_context(open(path, "rb"))
        except PermissionError as e:
            raise RootfsError(f"cannot read {what} {str(path)!r} ({e.strerror}); fix its permissions") from e
        except OSError as e:
            raise RootfsError(f"cannot open {what} {str(path)!r}: {e.strerror}") from e
        hasher = _HashingReader(f)
        buffered = io.BufferedReader(hasher, _CHUNK)
        try:
            tar = stack.enter_context(tarfile.open(fileobj=_decompressed(buffered), mode="r|", errorlevel=2))
        except CORRUPT as e:
            raise RootfsError(
                f"{what} {str(path)!r} is not a tar archive (plain, gzip, xz, bzip2 or zstd): {e}; "
                f"pass a directory, a tar of a root filesystem, an OCI layout or a docker save archive"
            ) from e
        yield tar, hasher


def _norm_member(name: str) -> str:
    """Root-relative normalised member name; raises ValueError on a '..' escape."""
    rel = posixpath.normpath("/" + name.lstrip("/")).lstrip("/")
    # normpath("/a/../../b") stays inside "/" and hides the escape, so check the raw parts.
    depth = 0
    for part in name.strip("/").split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                raise ValueError(f"member {name!r} escapes the root with '..'")
        elif part not in ("", "."):
            depth += 1
    return rel or "."


def _with(member: tarfile.TarInfo, **changes: object) -> tarfile.TarInfo:
    # TarInfo.replace() cannot change the type or device numbers, which whiteouts need.
    out = copy.copy(member)
    for key, value in changes.items():
        setattr(out, key, value)
    return out


class _Rejected(Exception):
    pass


def _check_parents(dest: str, rel: str, name: str) -> None:
    """Refuse ``rel`` if an existing component above it is not a real directory."""
    cur = dest
    for part in rel.split("/")[:-1]:
        cur = os.path.join(cur, part)
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            raise _Rejected(f"member {name!r} goes through '{part}', which is not a directory (a symlink?)")


class _Filter:
    """tarfile extraction filter: path safety, whiteout conversion, xattr collection."""

    def __init__(self, dest: str, whiteouts: bool) -> None:
        self.dest = dest
        self.whiteouts = whiteouts
        self.opaque: list[str] = []
        self.xattrs: list[tuple[str, dict[str, bytes]]] = []

    def __call__(self, member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
        try:
            rel = _norm_member(member.name)
        except ValueError as e:
            raise _Rejected(str(e)) from None
        base = posixpath.basename(rel)
        if self.whiteouts and base.startswith(_WH):
            parent = posixpath.dirname(rel)
            _check_parents(self.dest, rel, member.name)
            if base == _OPAQUE:
                self.opaque.append(parent)
                return None
            if base.startswith(_WH + _WH):  # aufs bookkeeping (.wh..wh.plnk and friends)
                return None
            rel = posixpath.join(parent, base[len(_WH) :])
            member = _with(
                member,
                name=rel,
                type=tarfile.CHRTYPE,
                devmajor=0,
                devminor=0,
                mode=0,
                size=0,
                linkname="",
                uid=0,
                gid=0,
            )
        elif rel == ".":
            if not member.isdir():
                raise _Rejected(f"member {member.name!r} would replace the root directory")
            return _with(member, name=".")
        else:
            member = _with(member, name=rel)
        _check_parents(self.dest, rel, member.name)
        target = os.path.join(self.dest, rel)
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            st = None
        if st is not None:
            if stat.S_ISDIR(st.st_mode):
                if not member.isdir():
                    raise _Rejected(f"member {member.name!r} would replace a directory")
            else:
                os.unlink(target)  # later members win; never write through an old symlink
        if member.islnk():
            try:
                link = _norm_member(member.linkname)
            except ValueError as e:
                raise _Rejected(f"hard link {member.name!r}: {e}") from None
            _check_parents(self.dest, link, member.linkname)
            try:
                lst = os.lstat(os.path.join(self.dest, link))
            except FileNotFoundError:
                raise _Rejected(
                    f"hard link {member.name!r} points to {member.linkname!r}, not extracted before it"
                ) from None
            if stat.S_ISDIR(lst.st_mode):
                raise _Rejected(f"hard link {member.name!r} points to a directory")
            if stat.S_ISLNK(lst.st_mode):
                # os.link would follow the symlink, possibly out of the layer: copy it instead.
                member = _with(
                    member, type=tarfile.SYMTYPE, linkname=os.readlink(os.path.join(self.dest, link))
                )
            else:
                # tarfile would chmod/chown the shared inode with the link's own header;
                # like GNU tar, leave the target's attributes alone.
                member = _with(
                    member,
                    linkname=link,
                    mode=stat.S_IMODE(lst.st_mode),
                    uid=lst.st_uid,
                    gid=lst.st_gid,
                    mtime=lst.st_mtime,
                )
        xattrs = {
            k[len(_XATTR_PAX) :]: v.encode("utf-8", "surrogateescape")
            for k, v in member.pax_headers.items()
            if k.startswith(_XATTR_PAX) and not k[len(_XATTR_PAX) :].startswith(_SKIP_XATTR)
        }
        if xattrs:
            self.xattrs.append((rel, xattrs))
        return member

    def finish(self) -> None:
        for rel, attrs in self.xattrs:
            path = os.path.join(self.dest, rel)
            for key, value in attrs.items():
                try:
                    os.setxattr(path, key, value, follow_symlinks=False)
                except OSError as e:
                    if e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
                        raise
                    log.debug("layers: %s: xattr %s not kept (%s)", path, key, e.strerror)
        for rel in self.opaque:
            _check_parents(self.dest, rel + "/x", rel)
            path = os.path.join(self.dest, rel)
            os.makedirs(path, exist_ok=True)
            os.setxattr(path, "trusted.overlay.opaque", b"y", follow_symlinks=False)


def extract(tar: tarfile.TarFile, dest: Path, what: str, *, whiteouts: bool = True) -> None:
    """Extract a streaming tar into the empty directory ``dest`` (see module docstring)."""
    filt = _Filter(str(dest), whiteouts)
    try:
        tar.extractall(dest, filter=filt, numeric_owner=True)
        filt.finish()
    except _Rejected as e:
        raise RootfsError(f"{what} is unsafe to extract: {e}; rebuild the archive without it") from e
    except CORRUPT as e:
        raise RootfsError(f"{what} is corrupt or truncated ({e}); download or export it again") from e
    except OSError as e:
        raise RootfsError(f"extracting {what} failed: {e}; check free space and that you are root") from e


def ensure_layer(blob: Path, hexdigest: str, what: str) -> tuple[Path, bool]:
    """The extracted layer of ``blob`` (a tar, maybe compressed, whose sha256 is ``hexdigest``).

    Extracts on first use; the bytes are hashed while extracting and a mismatch discards the
    layer. Returns the layer directory and whether this call extracted it.
    """
    final = layers_dir() / hexdigest

    def build(tmp: Path) -> None:
        with open_tar(blob, what) as (tar, hasher):
            extract(tar, tmp, f"{what} {str(blob)!r}")
            try:
                got = hasher.drain()
            except CORRUPT as e:
                raise RootfsError(f"{what} {str(blob)!r} could not be read to the end: {e}") from e
        if got != hexdigest:
            raise RootfsError(
                f"{what} {str(blob)!r} has sha256 {got}, but sha256:{hexdigest} was expected; "
                f"the file is corrupt or was changed, export the image again"
            )

    built = store.install(final, build)
    if built:
        log.info("layers: extracted %s into %s", blob, final)
    return final, built
