"""The image directory: what ``save``/``dump_workspace`` write and ``restore`` only reads.

    <path>/meta.json    format, versions, workspace config, shells, externals, checksums
    <path>/criu/        CRIU's images of the process tree (pages-*.img are the memory)
    <path>/layers/<i>/  the workspace's own overlay layers, topmost first (upper = layers/0)

The rootfs lowers below them are not copied: ``meta.json`` names them by content digest, or
the host's system by its fingerprint (:mod:`.bases`), and a load finds them in the node's layer
store or fetches them (:mod:`.layerstore`); :mod:`.transfer` moves an image between nodes.
Version 1 images (lowers by host path) are still read.
Every CRIU image file is recorded with its size, and every one but the memory pages with its
xxh3-128 digest, so a truncated, corrupt or foreign directory is refused before CRIU runs.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import xxhash

from ..errors import ImageError
from . import bases, layerstore
from .layerstore import Source

FORMAT = "bunshin-criu-workspace"
VERSION = 2
_READS = (1, 2)
META = "meta.json"


def criu_dir(path: Path) -> Path:
    return path / "criu"


def external_files(criu: Path, pycriu) -> dict[int, str]:
    """The external regular files CRIU recorded in the images at ``criu`` (``files.img``, read
    with ``pycriu``'s image module): file id -> its ``file[mnt:ino]`` key. One host file opened
    twice is two ids of one key."""
    with open(criu / "files.img", "rb") as fh:
        entries = pycriu.images.load(fh)["entries"]
    return {int(e["id"]): e["reg"]["name"] for e in entries
            if e.get("type") == "REG" and e["reg"].get("ext")}


def layer_dir(path: Path, i: int) -> Path:
    return path / "layers" / str(i)


def prepare(path: str | os.PathLike) -> Path:
    """The image directory for a dump: created if missing; an existing one must be empty."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise ImageError(f"{p} exists and is not a directory; give a new or empty directory")
        if any(p.iterdir()):
            raise ImageError(f"{p} is not empty; images are never overwritten: give a new or empty directory")
    else:
        p.mkdir(parents=True)
    criu_dir(p).mkdir()
    (p / "layers").mkdir()
    return p


def _digest(f: Path) -> str:
    h = xxhash.xxh3_128()
    with open(f, "rb") as fh:
        while b := fh.read(1 << 20):
            h.update(b)
    return h.hexdigest()


def _is_pages(name: str) -> bool:
    return name.startswith("pages-")


def inventory(path: Path) -> dict[str, list]:
    """{name: [size, digest or None]} of every CRIU image file (logs and stats excluded)."""
    out = {}
    for f in sorted(criu_dir(path).iterdir()):
        if f.suffix != ".img" or f.name.startswith("stats-"):
            continue
        out[f.name] = [f.stat().st_size, None if _is_pages(f.name) else _digest(f)]
    return out


def write_meta(path: Path, meta: dict) -> None:
    meta = {"format": FORMAT, "version": VERSION, **meta, "files": inventory(path)}
    tmp = path / (META + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, path / META)


def read_meta(path: str | os.PathLike, *, layers: Source | list[Source] | None = None) -> dict:
    """Validated metadata of an image directory (:func:`check_meta`) with ``rootfs_lowers``:
    this node's paths of the image's base, rootfs layers missing here fetched from ``layers``
    (sources as :func:`.layerstore.sources` takes them) or the shared stores of
    ``BUNSHIN_LAYER_STORE``."""
    meta = check_meta(path)
    if meta["version"] > 1:
        meta["rootfs_lowers"] = bases.resolve(meta, Path(path), layerstore.sources(layers))
    return meta


def check_meta(path: str | os.PathLike) -> dict:
    """Validated metadata of an image directory; :class:`ImageError` saying what is wrong."""
    p = Path(path)
    if not p.is_dir():
        raise ImageError(f"{p}: no such image directory (make one with tpl.save or bunshin.criu.dump_workspace)")
    mf = p / META
    if not mf.is_file():
        raise ImageError(f"{p}: no {META}: not a Bunshin workspace image (foreign or incomplete)")
    try:
        meta = json.loads(mf.read_text())
    except (OSError, ValueError) as e:
        raise ImageError(f"{mf}: unreadable or corrupt metadata: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise ImageError(f"{p}: {META} is not a Bunshin workspace image's (format {fmt!r})")
    if meta.get("version") not in _READS:
        raise ImageError(f"{p}: image format version {meta.get('version')!r}; this Bunshin reads versions "
                         f"{', '.join(map(str, _READS))}")
    files = meta.get("files") or {}
    if "pstree.img" not in files:
        raise ImageError(f"{p}: the metadata lists no pstree.img: incomplete image")
    for name, (size, digest) in files.items():
        f = criu_dir(p) / name
        try:
            real = f.stat().st_size
        except OSError:
            raise ImageError(f"{p}: {f.name} is missing: incomplete or damaged image") from None
        if real != size:
            raise ImageError(f"{p}: {f.name} has {real} bytes, the image was written with {size}: corrupt")
        if digest is not None and _digest(f) != digest:
            raise ImageError(f"{p}: {f.name} does not match its checksum: corrupt")
    for i in range(int(meta.get("layers", 0))):
        if not layer_dir(p, i).is_dir():
            raise ImageError(f"{p}: layer {i} ({layer_dir(p, i)}) is missing")
    if meta["version"] == 1:
        for lower in meta.get("rootfs_lowers", []):
            if not Path(lower).is_dir():
                raise ImageError(f"{p}: the rootfs layer {lower} the image was made on is gone")
    return meta


def discard(path: Path, keep_dir: bool = False) -> None:
    """Remove a half-written image (only ever one this process wrote): the directory, or
    with ``keep_dir`` (it existed, empty, before) its contents."""
    if not keep_dir:
        shutil.rmtree(path, ignore_errors=True)
        return
    for p in path.iterdir():
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink()
