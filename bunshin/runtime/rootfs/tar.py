"""Tar archives as rootfs: a root filesystem tarball, a ``docker save`` or an OCI archive.

A root filesystem tarball becomes one layer, ``<cache>/layers/<sha256 of the archive>/``. An
image archive is unpacked to a scratch directory, its layers are extracted by digest and
the scratch directory is removed.

Re-resolving skips hashing: ``<cache>/archives/<key>.json`` remembers the layers of an
archive keyed on its real path, device, inode, size, mtime and ctime. Any write to a file,
any ``touch`` to fake an old mtime, and any rename over it changes the ctime or the inode,
which the user cannot set back, so a changed archive always misses the index.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from ... import config
from ...errors import RootfsError
from . import layers as L
from .directory import check_looks_like_root
from .image_config import ImageConfig
from .model import Rootfs
from .oci import docker_config, docker_layers, oci_config, oci_layers

__all__ = ["archive_rootfs"]

log = logging.getLogger(__name__)

# Top-level names found in image archives; anything else means a root filesystem tarball.
_IMAGE_FILES = {"manifest.json", "index.json", "oci-layout", "repositories", "blobs", "."}


def _index_path(path: Path, st: os.stat_result) -> Path:
    key = f"{os.path.realpath(path)}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
    return (
        config.cache_dir()
        / "archives"
        / (hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest() + ".json")
    )


def _from_index(index: Path, source: str) -> Rootfs | None:
    try:
        entry = json.loads(index.read_bytes())
        lowers = tuple(L.layers_dir() / name for name in entry["layers"])
        image = ImageConfig.from_dict(entry["image"]) if entry.get("image") is not None else None
        if entry["kind"] != "tar" and image is None:
            return None  # remembered before image configs were: resolve it again for its config
        if all(p.is_dir() for p in lowers):
            return Rootfs(lowers=lowers, kind=entry["kind"], source=source, image=image)
    except (OSError, ValueError, KeyError, TypeError, RootfsError):
        pass
    return None


def _write_index(index: Path, rootfs: Rootfs) -> None:
    index.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=index.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"kind": rootfs.kind, "layers": [p.name for p in rootfs.lowers],
                       "image": rootfs.image.to_dict() if rootfs.image is not None else None}, f)
        os.replace(tmp, index)
    except BaseException:
        os.unlink(tmp)
        raise


def _classify(path: Path, source: str) -> str:
    seen: set[str] = set()
    with L.open_tar(path, "rootfs archive") as (tar, _):
        try:
            for member in tar:
                rel = member.name.lstrip("/")
                rel = rel.removeprefix("./")
                top = rel.split("/", 1)[0] or "."
                if top == rel and top in ("manifest.json", "oci-layout", "index.json"):
                    seen.add(top)
                    if "manifest.json" in seen or {"oci-layout", "index.json"} <= seen:
                        break
                elif not (top in _IMAGE_FILES or top.endswith(".json") or _is_hex_id(top)):
                    return "tar"
        except L.CORRUPT as e:
            raise RootfsError(
                f"rootfs archive {source!r} is corrupt or truncated ({e}); download or export it again"
            ) from e
    if "manifest.json" in seen:
        return "docker-archive"
    if {"oci-layout", "index.json"} <= seen:
        return "oci"
    return "tar"


def _is_hex_id(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def _dedup_topmost(lowers: list[Path]) -> tuple[Path, ...]:
    """Drop repeated layers, keeping the topmost copy (the lower copy can change nothing)."""
    seen: set[Path] = set()
    out = []
    for p in lowers:
        if p not in seen:
            seen.add(p)
            out.append(p)
    return tuple(out)


def image_rootfs(root: Path, kind: str, source: str) -> Rootfs:
    """Extract the layers of an unpacked image (OCI layout or docker save tree)."""
    docker = kind == "docker-archive"
    blobs = docker_layers(root, source) if docker else oci_layers(root, source)
    image = ImageConfig.of_image(docker_config(root, source) if docker else oci_config(root, source))
    extracted = [L.ensure_layer(blob, hexdigest, f"layer of {source!r}")[0] for blob, hexdigest in blobs]
    if not extracted:
        raise RootfsError(f"{source}: the image has no layers; export a non-empty image")
    return Rootfs(lowers=_dedup_topmost(extracted[::-1]), kind=kind, source=source, image=image)


def archive_rootfs(path: Path, source: str) -> Rootfs:
    """Resolve a tar archive (see module docstring)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise RootfsError(f"cannot stat rootfs archive {source!r}: {e.strerror}") from e
    index = _index_path(path, st)
    cached = _from_index(index, source)
    if cached is not None:
        return cached
    kind = _classify(path, source)
    if kind == "tar":
        try:
            hexdigest = L.sha256_file(path)
        except OSError as e:
            raise RootfsError(f"cannot read rootfs archive {source!r}: {e.strerror}") from e
        layer, built = L.ensure_layer(path, hexdigest, "rootfs archive")
        try:
            check_looks_like_root(layer, source)
        except RootfsError:
            if built:  # do not keep a wrong archive's bytes in the cache
                shutil.rmtree(layer, ignore_errors=True)
            raise
        rootfs = Rootfs(lowers=(layer,), kind="tar", source=source)
    else:
        scratch_parent = config.cache_dir() / "tmp"
        scratch_parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="image-", dir=scratch_parent))
        try:
            with L.open_tar(path, "image archive") as (tar, _):
                L.extract(tar, scratch, f"image archive {source!r}", whiteouts=False)
            rootfs = image_rootfs(scratch, kind, source)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            try:
                scratch_parent.rmdir()
            except OSError:
                pass  # another resolver is using it
    _write_index(index, rootfs)
    return rootfs
