"""Minimal Debian roots built with mmdebstrap (or debootstrap) and kept in the cache.

A root lives at ``<cache>/debian/<suite>-<variant>-<hash of the extra packages>/``; it is
built once into a temporary directory and renamed into place, so a half-built root is never
used and concurrent callers wait for one build.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from ... import config
from ...errors import RootfsError
from . import store
from .directory import check_looks_like_root

__all__ = ["MIRROR", "build_debian", "debian_dir"]

log = logging.getLogger(__name__)

MIRROR = "http://deb.debian.org/debian"
_SUITE = re.compile(r"^[a-z][a-z0-9-]{1,31}$")
_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")
_VARIANTS = {
    "mmdebstrap": {
        "extract",
        "custom",
        "essential",
        "apt",
        "required",
        "minbase",
        "buildd",
        "important",
        "standard",
    },
    "debootstrap": {"minbase", "buildd"},
}
_BUILD_TIMEOUT = 3600


def debian_dir(suite: str, variant: str, include: Sequence[str]) -> Path:
    """Where ``build_debian`` keeps the root for these arguments."""
    packages = ",".join(sorted(set(include)))
    tag = hashlib.sha256(packages.encode()).hexdigest()[:12]
    return config.cache_dir() / "debian" / f"{suite}-{variant}-{tag}"


def _tool() -> str:
    """The bootstrapper to use, installing mmdebstrap through apt if neither is present."""
    for tool in ("mmdebstrap", "debootstrap"):
        if shutil.which(tool):
            return tool
    if shutil.which("apt-get"):
        log.info("debian: installing mmdebstrap with apt-get")
        done = subprocess.run(
            ["apt-get", "install", "-y", "--no-install-recommends", "mmdebstrap"],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode == 0 and shutil.which("mmdebstrap"):
            return "mmdebstrap"
        log.warning("debian: apt-get install mmdebstrap failed: %s", done.stderr.strip()[-500:])
    raise RootfsError("neither mmdebstrap nor debootstrap is installed; run 'apt-get install mmdebstrap'")


def build_debian(
    suite: str = "bookworm",
    *,
    variant: str = "minbase",
    include: Sequence[str] = (),
    force: bool = False,
) -> Path:
    """Build (or reuse) a minimal Debian root and return its directory.

    ``include`` names extra packages; ``force`` rebuilds and swaps the root in place (do not
    force while workspaces use it). Needs root and access to the Debian mirror; building
    takes a minute or two. The result is usable as a directory rootfs.
    """
    if not isinstance(suite, str) or not _SUITE.match(suite):
        raise RootfsError(f"Debian suite {suite!r} is not a suite name; use e.g. 'bookworm' or 'trixie'")
    if isinstance(include, str):
        raise RootfsError("include must be a list of package names, not one string; e.g. include=['git']")
    bad = [p for p in include if not isinstance(p, str) or not _PACKAGE.match(p)]
    if bad:
        raise RootfsError(
            f"include has invalid Debian package names {bad!r}; use names like 'git' or 'python3'"
        )
    final = debian_dir(suite, variant, include)
    if final.is_dir() and not force:
        return final
    tool = _tool()
    if variant not in _VARIANTS[tool]:
        raise RootfsError(
            f"variant {variant!r} is not one {tool} builds; use one of {sorted(_VARIANTS[tool])}"
        )

    def build(tmp: Path) -> None:
        cmd = [tool, f"--variant={variant}"]
        if include:
            cmd.append("--include=" + ",".join(sorted(set(include))))
        cmd += [suite, str(tmp), MIRROR]
        log.info("debian: %s", " ".join(cmd))
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT, check=False)
        except subprocess.TimeoutExpired as e:
            raise RootfsError(
                f"{tool} did not finish within {_BUILD_TIMEOUT} s; check the mirror {MIRROR}"
            ) from e
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-8:])
            raise RootfsError(
                f"{tool} failed to build Debian {suite} ({variant}) with exit code {done.returncode}; "
                f"check the suite name and that {MIRROR} is reachable:\n{tail}"
            )
        check_looks_like_root(tmp, f"debian:{suite}")

    store.install(final, build, replace=force)
    return final
