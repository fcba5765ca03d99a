"""Image layouts on disk: OCI image layout directories and ``docker save`` trees.

Both yield the image's layer blobs bottom-first as (path, sha256 hex). For an OCI index with
several manifests the linux/amd64 one is taken; attestation manifests are skipped.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ...errors import RootfsError
from .layers import check_hex, sha256_file

__all__ = ["PLATFORM", "docker_config", "docker_layers", "is_docker_tree", "is_oci_layout", "oci_config",
           "oci_layers"]

PLATFORM = ("linux", "amd64")

_INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
_MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
_MAX_DEPTH = 4


def is_oci_layout(root: Path) -> bool:
    """True if ``root`` holds an OCI image layout (``oci-layout`` and ``index.json``)."""
    return (root / "oci-layout").is_file() and (root / "index.json").is_file()


def is_docker_tree(root: Path) -> bool:
    """True if ``root`` holds an unpacked ``docker save`` archive (``manifest.json``)."""
    return (root / "manifest.json").is_file()


def _load_json(path: Path, source: str, what: str) -> Any:
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise RootfsError(
            f"{source}: {what} {path.name!r} is missing; the image is incomplete, export it again"
        ) from None
    except (OSError, ValueError) as e:
        raise RootfsError(
            f"{source}: {what} {path.name!r} is not valid JSON ({e}); export the image again"
        ) from e


def _blob(root: Path, digest: Any, source: str) -> tuple[Path, str]:
    if not isinstance(digest, str):
        raise RootfsError(f"{source}: a descriptor has no digest; the image index is malformed")
    hexpart = check_hex(digest, source)
    path = root / "blobs" / "sha256" / hexpart
    if not path.is_file():
        raise RootfsError(f"{source}: blob {digest} is missing from blobs/sha256/; the layout is incomplete")
    return path, hexpart


def _verified_json(root: Path, desc: dict, source: str) -> Any:
    path, hexpart = _blob(root, desc.get("digest"), source)
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != hexpart:
        raise RootfsError(
            f"{source}: blob {desc.get('digest')} does not match its digest; the layout is corrupt"
        )
    try:
        return json.loads(data)
    except ValueError as e:
        raise RootfsError(f"{source}: blob {desc.get('digest')} is not JSON ({e})") from e


def _platform(desc: dict) -> tuple[str, str] | None:
    p = desc.get("platform")
    if not isinstance(p, dict):
        return None
    return (str(p.get("os")), str(p.get("architecture")))


def _is_attestation(desc: dict) -> bool:
    ann = desc.get("annotations") or {}
    return "vnd.docker.reference.type" in ann or _platform(desc) == ("unknown", "unknown")


def _manifests(root: Path, index: Any, source: str, depth: int) -> list[tuple[dict, Any]]:
    """Flatten nested indexes into (descriptor, manifest) pairs."""
    if depth > _MAX_DEPTH or not isinstance(index, dict) or not isinstance(index.get("manifests"), list):
        raise RootfsError(f"{source}: image index has no 'manifests' list; the layout is malformed")
    found: list[tuple[dict, Any]] = []
    for desc in index["manifests"]:
        if not isinstance(desc, dict) or _is_attestation(desc):
            continue
        media = desc.get("mediaType")
        if media is not None and media not in _INDEX_TYPES + _MANIFEST_TYPES:
            continue
        doc = _verified_json(root, desc, source)
        if media in _INDEX_TYPES or (media is None and isinstance(doc, dict) and "manifests" in doc):
            for sub_desc, sub in _manifests(root, doc, source, depth + 1):
                sub_desc.setdefault("platform", desc.get("platform"))
                found.append((sub_desc, sub))
        else:
            found.append((desc, doc))
    return found


def _pick(found: list[tuple[dict, Any]], source: str) -> Any:
    if not found:
        raise RootfsError(f"{source}: the OCI index lists no image manifest; export the image again")
    if len(found) == 1 and _platform(found[0][0]) in (None, PLATFORM):
        return found[0][1]
    for desc, doc in found:
        if _platform(desc) == PLATFORM:
            return doc
    have = ", ".join(sorted({"/".join(p) if (p := _platform(d)) else "unspecified" for d, _ in found}))
    raise RootfsError(
        f"{source}: no linux/amd64 image among its manifests (it has: {have}); "
        f"pull or export the image for linux/amd64"
    )


def _oci_manifest(root: Path, source: str) -> Any:
    layout = _load_json(root / "oci-layout", source, "layout marker")
    if not isinstance(layout, dict) or "imageLayoutVersion" not in layout:
        raise RootfsError(
            f"{source}: 'oci-layout' has no imageLayoutVersion; this is not an OCI image layout"
        )
    return _pick(_manifests(root, _load_json(root / "index.json", source, "index"), source, 0), source)


def oci_config(root: Path, source: str) -> Any:
    """The image config document of the linux/amd64 image in an OCI layout ({} if none)."""
    desc = _oci_manifest(root, source).get("config")
    return _verified_json(root, desc, source) if isinstance(desc, dict) else {}


def oci_layers(root: Path, source: str) -> list[tuple[Path, str]]:
    """Layer blobs of the linux/amd64 image in an OCI layout, bottom-first."""
    manifest = _oci_manifest(root, source)
    layers = manifest.get("layers") if isinstance(manifest, dict) else None
    if not isinstance(layers, list):
        raise RootfsError(f"{source}: the image manifest has no 'layers' list; export the image again")
    return [_blob(root, d.get("digest") if isinstance(d, dict) else None, source) for d in layers]


def docker_config(root: Path, source: str) -> Any:
    """The image config document of the one image in a ``docker save`` tree ({} if none)."""
    manifest = _load_json(root / "manifest.json", source, "manifest")
    entry = manifest[0] if isinstance(manifest, list) and manifest else None
    if not isinstance(entry, dict) or not isinstance(entry.get("Config"), str):
        return {}
    return _load_json(_inside(root, entry["Config"], source), source, "image config")


def docker_layers(root: Path, source: str) -> list[tuple[Path, str]]:
    """Layer tarballs of the one image in a ``docker save`` tree, bottom-first.

    The expected digest of each layer is its diff_id from the image config when the layer
    is uncompressed (legacy ``<id>/layer.tar``) or the blob name (``blobs/sha256/<hex>``).
    """
    manifest = _load_json(root / "manifest.json", source, "manifest")
    if not isinstance(manifest, list) or not manifest:
        raise RootfsError(f"{source}: manifest.json lists no image; save an image with 'docker save IMAGE'")
    if len(manifest) > 1:
        tags = [", ".join(m.get("RepoTags") or ["<untagged>"]) for m in manifest if isinstance(m, dict)]
        raise RootfsError(
            f"{source}: holds {len(manifest)} images ({'; '.join(tags)}); save one image per archive"
        )
    entry = manifest[0]
    names = entry.get("Layers") if isinstance(entry, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise RootfsError(f"{source}: manifest.json has no 'Layers' list; the archive is malformed")
    diff_ids: list = []
    if isinstance(entry.get("Config"), str):
        cfg = _load_json(_inside(root, entry["Config"], source), source, "image config")
        rootfs = cfg.get("rootfs") if isinstance(cfg, dict) else None
        diff_ids = rootfs.get("diff_ids", []) if isinstance(rootfs, dict) else []
    out: list[tuple[Path, str]] = []
    for i, name in enumerate(names):
        path = _inside(root, name, source)
        if not path.is_file():
            raise RootfsError(f"{source}: layer {name!r} named in manifest.json is missing")
        parts = Path(name).parts
        if len(parts) == 3 and parts[:2] == ("blobs", "sha256"):
            hexpart = check_hex("sha256:" + parts[2], source)
        elif i < len(diff_ids) and isinstance(diff_ids[i], str):
            hexpart = check_hex(diff_ids[i], source)
        else:
            hexpart = sha256_file(path)
        out.append((path, hexpart))
    return out


def _inside(root: Path, name: str, source: str) -> Path:
    path = (root / name).resolve()
    if not path.is_relative_to(root.resolve()):
        raise RootfsError(f"{source}: manifest entry {name!r} points outside the archive")
    return path
