"""The node's layer store: rootfs layers by content digest, and where missing ones come from.

A layer's digest (:func:`tree_digest`) is a sha256 over its tree: every entry's path, type,
mode, owner, extended attributes (an overlay's opaque marks among them), device numbers (its
whiteouts), link target and file contents, in name order; not its times (a copy or a transfer
keeps contents, not always directory mtimes). The store is ``<state dir>/layers/<digest>``: a
symbolic link to a layer this node already has (a cached rootfs layer, a Debian root) or a
directory holding one received from elsewhere. Layers never change once made, so a layer of
the cache keeps its digest beside it (``.<name>.digest``) and it is computed once; a directory
the user gave is hashed at every save.

A missing layer comes from a *source*: a shared store directory (the same ``<digest>/`` layout,
``BUNSHIN_LAYER_STORE`` or ``layers=``), or a callable ``source(digest)`` giving the layer's tar
stream in chunks (:func:`layer_chunks` on the node that has it) or ``None`` when it has not.
What arrives is written into a temporary directory, hashed, and put in place only if its digest
is the one asked for.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, cast

from .. import config
from ..errors import ImageError, LayerCorrupt, LayerMissing
from ..runtime import statefs
from ..runtime.rootfs import store as _install
from ..runtime.rootfs.layers import sha256_file

__all__ = ["SCHEME", "Source", "fetch", "layer_chunks", "local", "publish", "receive_layer", "register",
           "sources", "store_dir", "tree_digest", "digest_of"]

SCHEME = "bunshin-tree-sha256/1"
_CHUNK = 1 << 20
_HEX = set("0123456789abcdef")
# GNU tar keeps owners, modes, devices, hard links and every extended attribute (trusted.*
# too, as root) both ways
_TAR = ["tar", "--numeric-owner", "--xattrs", "--xattrs-include=*", "--format=posix"]

Source = str | os.PathLike | Callable[[str], Iterable[bytes] | None]


def check_digest(digest: object) -> str:
    if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _HEX:
        raise ImageError(f"{digest!r} is not a layer digest (64 lowercase hex digits)")
    return digest


def _field(h, b: bytes) -> None:
    h.update(len(b).to_bytes(8, "little"))
    h.update(b)


def _file_hash(path: bytes) -> bytes:
    return bytes.fromhex(sha256_file(Path(os.fsdecode(path))))


def tree_digest(root: str | os.PathLike) -> str:
    """The content digest of the layer at ``root`` (see the module docstring)."""
    h = hashlib.sha256(SCHEME.encode())
    top = os.fsencode(root)
    stack = [b""]
    while stack:
        rel = stack.pop()
        path = os.path.join(top, rel) if rel else top
        st = os.lstat(path)
        kind = stat.S_IFMT(st.st_mode)
        if kind == stat.S_IFSOCK:
            continue  # not carried by tar; nothing a lower layer can serve
        _field(h, rel)
        _field(h, b"%o %d %d" % (st.st_mode, st.st_uid, st.st_gid))
        for name in sorted(os.listxattr(path, follow_symlinks=False)):
            _field(h, name.encode())
            _field(h, os.getxattr(path, name, follow_symlinks=False))
        if kind == stat.S_IFREG:
            _field(h, b"%d" % st.st_size + _file_hash(path))
        elif kind == stat.S_IFLNK:
            _field(h, os.readlink(path))
        elif kind in (stat.S_IFCHR, stat.S_IFBLK):
            _field(h, b"%d:%d" % (os.major(st.st_rdev), os.minor(st.st_rdev)))
        elif kind == stat.S_IFDIR:
            names = sorted(os.listdir(path), reverse=True)  # popped in name order
            stack.extend(os.path.join(rel, n) if rel else n for n in names)
    return h.hexdigest()


def _sidecar(layer: Path) -> Path:
    return layer.with_name(f".{layer.name}.digest")


def _kept_beside(layer: Path) -> bool:
    """Layers the cache made: they never change, so their digest can be kept."""
    cache = config.cache_dir().resolve()
    return cache in layer.parents


def digest_of(layer: str | os.PathLike) -> str:
    """The digest of a rootfs layer of this node: its store name, the one kept beside it, or
    computed (and kept, for the cache's layers)."""
    real = Path(os.path.realpath(layer))
    store = store_dir().resolve()
    if real.parent == store:
        return check_digest(real.name)
    if not _kept_beside(real):
        return tree_digest(real)
    side = _sidecar(real)
    st = os.stat(real)
    stamp = [st.st_dev, st.st_ino, st.st_ctime_ns]
    try:
        kept = json.loads(side.read_text())
        if kept.get("scheme") == SCHEME and kept.get("stamp") == stamp:
            return check_digest(kept["digest"])
    except (OSError, ValueError, AttributeError, KeyError, ImageError):
        pass
    digest = tree_digest(real)
    tmp = side.with_name(side.name + f".tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.write_text(json.dumps({"scheme": SCHEME, "digest": digest, "stamp": stamp}))
    os.replace(tmp, side)
    return digest


def store_dir() -> Path:
    """``<state dir>/layers`` on the mounted state file system."""
    d = statefs.ensure() / "layers"
    d.mkdir(exist_ok=True)
    return d


def local(digest: str) -> Path | None:
    """This node's copy of the layer ``digest``, or None."""
    p = store_dir() / check_digest(digest)
    return Path(os.path.realpath(p)) if p.is_dir() else None


def register(layer: str | os.PathLike, digest: str) -> None:
    """Put this node's layer ``layer`` in the store (a link: the store serves it from there)."""
    p = store_dir() / check_digest(digest)
    real = os.path.realpath(layer)
    if p.is_dir() or (real == str(p)):
        return
    tmp = p.with_name(f".tmp-{digest}-{os.getpid()}-{threading.get_ident()}")
    os.symlink(real, tmp)
    os.replace(tmp, p)  # over a link left dangling by a removed cache entry too


def sources(given: Source | Sequence[Source] | None = None) -> list[Source]:
    """The sources to try, in order: the caller's, then ``BUNSHIN_LAYER_STORE``'s directories."""
    out: list[Source] = []
    if isinstance(given, (list, tuple)):
        out += given
    elif given is not None:
        out.append(cast(Source, given))
    out += [Path(p) for p in config.layer_store().split(":") if p]
    return out


def _describe(src: Source) -> str:
    if callable(src):
        return f"source {getattr(src, '__qualname__', None) or type(src).__name__}"
    return f"store {os.fspath(src)}"


def fetch(digest: str, srcs: Sequence[Source]) -> Path:
    """The layer ``digest``: this node's, or fetched from the first of ``srcs`` that has it."""
    if (have := local(check_digest(digest))) is not None:
        return have
    looked = [f"this node's store {store_dir()}"]
    for src in srcs:
        if callable(src):
            try:
                chunks = src(digest)
            except (LookupError, LayerMissing):  # layer_chunks itself is a source: LayerMissing
                chunks = None
            if chunks is not None:
                return receive_layer(digest, chunks, _describe(src))
        else:
            there = Path(src) / digest
            if there.is_dir():
                return _install_verified(digest, functools.partial(copy_layer, there), _describe(src))
        looked.append(_describe(src))
    raise LayerMissing(f"rootfs layer {digest} is not on this node and no source has it (looked in: "
                       f"{'; '.join(looked)}); give Template.load a source (layers=<shared store "
                       f"directory or callable>) or set BUNSHIN_LAYER_STORE", digest=digest)


def copy_layer(src: Path, dst: Path) -> None:
    """Copy an overlay layer exactly (whiteouts: 0/0 char devices, opaque-dir xattrs, owners)
    into the directory ``dst``: reflinks where both share a file system; not hard links,
    through which a change to one copy would reach the other."""
    r = subprocess.run(["cp", "-a", "--reflink=auto", f"{src}/.", str(dst)], capture_output=True, text=True,
                       check=False)
    if r.returncode != 0:
        raise ImageError(f"copying layer {src} into {dst} failed: {r.stderr.strip()[-300:]}")


def _install_verified(digest: str, fill: Callable[[Path], None], where: str) -> Path:
    final = store_dir() / digest
    if final.is_symlink() and not final.exists():
        final.unlink()  # the local layer it named was removed: the fetched copy takes its place

    def build(tmp: Path) -> None:
        fill(tmp)
        got = tree_digest(tmp)
        if got != digest:
            raise LayerCorrupt(f"rootfs layer {digest} from {where} has digest {got}: corrupt or changed "
                               "there; nothing was kept", digest=digest)

    _install.install(final, build)
    return Path(os.path.realpath(final))


def untar(chunks: Iterable[bytes], dest: Path) -> tuple[int, str]:
    """Extract the tar stream ``chunks`` into ``dest`` with GNU tar; (its exit code, the tail of
    what it said)."""
    # tar's complaints go to a file: a pipe read only at the end fills (64 KiB of warnings,
    # one per socket in a layer) and stops tar, and us with it
    errf = tempfile.TemporaryFile()
    p = subprocess.Popen([*_TAR, "-x", "-p", "-f", "-", "-C", str(dest)], stdin=subprocess.PIPE,
                         stderr=errf)
    assert p.stdin is not None
    try:
        for c in chunks:
            p.stdin.write(c)  # buffered: all of it, even where one write(2) takes less
    except BrokenPipeError:
        pass  # tar gave up: it says why
    finally:
        try:
            p.stdin.close()  # also when the stream broke off: tar sees its end and stops
        except BrokenPipeError:
            pass
        p.wait()
    return p.returncode, _tail(errf)


def _tail(f: IO[bytes], n: int = 300) -> str:
    """The last ``n`` characters of what a subprocess wrote to ``f``; closes it."""
    with f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 4 * n))
        return f.read().decode(errors="replace").strip()[-n:]


def receive_layer(digest: str, chunks: Iterable[bytes], where: str = "a stream") -> Path:
    """Put the layer whose tar stream (:func:`layer_chunks`) ``chunks`` carry into the store,
    once its digest is checked; returns its directory. Memory stays at one chunk."""
    check_digest(digest)

    def fill(tmp: Path) -> None:
        rc, err = untar(chunks, tmp)
        if rc != 0:
            raise LayerCorrupt(f"rootfs layer {digest} from {where} is not a readable tar stream: {err}",
                               digest=digest)

    return _install_verified(digest, fill, where)


def layer_chunks(digest: str, chunk: int = _CHUNK) -> Iterator[bytes]:
    """The layer ``digest`` of this node's store as a tar stream, ``chunk`` bytes at a time."""
    layer = local(digest)
    if layer is None:
        raise LayerMissing(f"rootfs layer {digest} is not in this node's store {store_dir()}", digest=digest)
    return tar_chunks(layer, chunk)


def tar_chunks(directory: Path, chunk: int = _CHUNK) -> Iterator[bytes]:
    """``directory`` as a GNU tar stream, ``chunk`` bytes at a time."""
    errf = tempfile.TemporaryFile()  # as in untar: never a pipe read only at the end
    p = subprocess.Popen([*_TAR, "-c", "-f", "-", "-C", str(directory), "."], stdout=subprocess.PIPE,
                         stderr=errf)
    assert p.stdout is not None
    read_all = False
    try:
        while b := p.stdout.read(chunk):
            yield b
        read_all = True
    finally:
        p.stdout.close()  # a reader that stopped early: tar ends on the broken pipe
        p.wait()
    if read_all and p.returncode != 0:
        raise ImageError(f"reading {directory} failed: {_tail(errf)}")


def publish(digest: str, store: str | os.PathLike) -> Path:
    """Copy this node's layer ``digest`` into the shared store directory ``store``."""
    layer = local(digest)
    if layer is None:
        raise LayerMissing(f"rootfs layer {digest} is not in this node's store {store_dir()}", digest=digest)
    final = Path(store) / digest
    _install.install(final, lambda tmp: copy_layer(layer, tmp))
    return final


def remove(digest: str) -> None:
    """Drop ``digest`` from this node's store (a link goes, the layer it names stays)."""
    p = store_dir() / check_digest(digest)
    if p.is_symlink():
        p.unlink()
    elif p.is_dir():
        shutil.rmtree(p)
