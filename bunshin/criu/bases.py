"""An image's base: the rootfs lowers below the workspace's own layers, named by content.

A save records each lower as ``{"digest": <layer digest>}`` (:mod:`.layerstore`; the layer is
put in the node's store, and in the shared stores ``BUNSHIN_LAYER_STORE`` names) or, for the
host's own system (the default rootfs, which cannot be copied), as ``{"host": <fingerprint>}``:
what identifies the host's system (its os-release and installed packages) and the Bunshin
directories its view of the host hides. A load resolves each digest to this node's copy,
fetching it from a source when missing, and refuses a host whose fingerprint differs.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

from ..errors import ForeignHost, ImageError
from ..runtime.rootfs.default import MOUNT_POINTS, PRIVATE, default_rootfs
from . import layerstore
from .layerstore import Source

__all__ = ["HOST", "digests", "host_fingerprint", "record", "resolve"]

HOST = "/"
_OS_RELEASE = ("/etc/os-release", "/usr/lib/os-release")
_DPKG_STATUS = Path("/var/lib/dpkg/status")
_PACKAGES: dict[tuple[int, int, int], tuple[int, str]] = {}


def _os_release() -> tuple[str, str]:
    """(PRETTY_NAME, sha256 of the file) of the host's os-release."""
    for p in _OS_RELEASE:
        try:
            data = Path(p).read_bytes()
        except OSError:
            continue
        name = next((ln.split("=", 1)[1].strip().strip('"') for ln in data.decode(errors="replace").splitlines()
                     if ln.startswith("PRETTY_NAME=")), "unknown")
        return name, hashlib.sha256(data).hexdigest()
    return "unknown", ""


def _packages() -> tuple[int, str]:
    """(how many, sha256 of the sorted ``name arch version`` list) of dpkg's installed packages;
    read again only when dpkg's status file changed (every dump of a host-rootfs workspace asks)."""
    try:
        st = os.stat(_DPKG_STATUS)
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key in _PACKAGES:
            return _PACKAGES[key]
        text = _DPKG_STATUS.read_text(errors="replace")
    except OSError:
        return 0, ""
    rows = []
    for block in text.split("\n\n"):
        f = dict(ln.split(": ", 1) for ln in block.splitlines() if ": " in ln and not ln.startswith(" "))
        if f.get("Status", "").endswith(" installed") and "Package" in f:
            rows.append(f"{f['Package']} {f.get('Architecture', '')} {f.get('Version', '')}")
    rows.sort()
    _PACKAGES.clear()
    _PACKAGES[key] = len(rows), hashlib.sha256("\n".join(rows).encode()).hexdigest()
    return _PACKAGES[key]


def host_fingerprint() -> dict:
    """What identifies the host's system as a workspace sees it through the default rootfs."""
    name, release = _os_release()
    count, packages = _packages()
    hidden = sorted(set(default_rootfs().mask) - set(MOUNT_POINTS + PRIVATE))
    return {"os": name, "os_release": release, "packages": packages, "package_count": count,
            "bunshin_dirs": hidden}


def record(rootfs_lowers: Sequence[str]) -> list[dict]:
    """The base entries of an image made on ``rootfs_lowers`` (topmost first); each layer is
    put in this node's store (and the shared stores) so that other nodes can fetch it."""
    out: list[dict] = []
    shared = [s for s in layerstore.sources() if not callable(s)]
    for lower in rootfs_lowers:
        if os.path.realpath(lower) == HOST:
            out.append({"host": host_fingerprint()})
            continue
        digest = layerstore.digest_of(lower)
        layerstore.register(lower, digest)
        for store in shared:
            layerstore.publish(digest, store)
        out.append({"digest": digest})
    return out


def digests(meta: dict) -> list[str]:
    """The layer digests an image's base names (the host's system is none)."""
    return [b["digest"] for b in meta.get("bases", []) if "digest" in b]


def check_host(want: dict, where: Path) -> None:
    """Refuse this host unless its fingerprint is ``want``'s, naming what differs."""
    have = host_fingerprint()
    for key, what in (("os_release", "OS release"), ("packages", "set of installed packages")):
        if have[key] != want.get(key):
            raise ForeignHost(
                f"{where} was saved on a host's own system ({want.get('os')!r}, {want.get('package_count')} "
                f"packages) and this host has another {what} ({have['os']!r}, {have['package_count']} packages): "
                "its processes would see other files. Load it on a node running the same system image, "
                "or save it from a workspace on a rootfs layer (rootfs=..., which travels)")
    unmasked = sorted(set(have["bunshin_dirs"]) - set(want.get("bunshin_dirs", [])))
    if unmasked:
        raise ForeignHost(
            f"{where}: this host's Bunshin directories {unmasked} lie in the host's view and the image "
            "does not hide them (it was saved with other BUNSHIN_STATE_DIR / BUNSHIN_CACHE_DIR); use "
            "the same directories on every node")


def resolve(meta: dict, where: Path, srcs: Sequence[Source] | None = None) -> list[str]:
    """This node's paths of the image's base, topmost first: layers from the node's store or
    fetched from ``srcs`` (default: the shared stores of ``BUNSHIN_LAYER_STORE``)."""
    srcs = layerstore.sources() if srcs is None else srcs
    out = []
    for b in meta.get("bases", []):
        if "host" in b:
            check_host(b["host"], where)
            out.append(HOST)
        elif "digest" in b:
            out.append(str(layerstore.fetch(b["digest"], srcs)))
        else:
            raise ImageError(f"{where}: a base entry names neither a layer digest nor the host: {b!r}")
    return out
