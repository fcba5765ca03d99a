"""Building Bunshin's CRIU: Debian's CRIU source with the patches of ``criu/patches``.

Debian's source of CRIU (``apt-get source --tar-only`` against a private copy of the suite's
lists, so apt checks it against the signed archive and the system's apt configuration is left
alone) is unpacked, patched and built with the host's compiler against the host's libraries
(CRIU's build dependencies come from Debian: :data:`BUILD_DEPS`, installed by
``scripts/install-deps.sh``; ``make install`` then runs ``bunshin criu provision
--if-needed``). Only the ``criu`` binary is installed, into ``config.cache_dir()/criu-bunshin``,
with a copy of the private stock install's pycriu (:func:`bunshin.criu_locate.provision_criu`,
made first; its version is the source's). The build names its patches as its source revision
(``gitid``: ``bunshin+<patch>+...``; the version's ``extra`` would need a quoted make
variable), which RPC's ``VERSION`` reports and :func:`bunshin.criu_locate.inspect_criu` reads
into ``CriuInfo.patches``.

A build is kept while its stamp (the source's name and every patch's digest) matches: a changed
patch builds again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

from . import config
from .errors import UnsupportedKernel

__all__ = ["BUILD_DEPS", "GITID_PREFIX", "build_criu", "is_current", "patch_names", "patches",
           "patched_prefix", "patches_in"]

log = logging.getLogger("bunshin.criu")

#: Debian packages CRIU's ``make criu`` needs beyond a C toolchain
BUILD_DEPS = ("protobuf-c-compiler", "libprotobuf-c-dev", "protobuf-compiler", "libprotobuf-dev",
              "libnl-3-dev", "libnet1-dev", "libcap-dev", "uuid-dev", "libbsd-dev", "libnftables-dev",
              "libgnutls28-dev", "pkg-config", "patch")
GITID_PREFIX = "bunshin"
_SITE = Path("sysroot/usr/lib/python3/dist-packages")  # where criu_rpc.pycriu_dirs looks


def patches_dir() -> Path:
    """The source tree's ``criu/patches`` when run from one, else the package's copy (installed
    beside the plugin)."""
    tree = Path(__file__).resolve().parent.parent / "criu" / "patches"
    if tree.is_dir():
        return tree
    from ._core import _syscalls

    return Path(_syscalls.__file__).with_name("criu-patches")


def patches() -> list[Path]:
    return sorted(patches_dir().glob("*.patch"))


def patch_names() -> tuple[str, ...]:
    return tuple(p.stem for p in patches())


def patches_in(gitid: str) -> tuple[str, ...]:
    """The Bunshin patches a CRIU names as its version's ``gitid``; () for any other CRIU."""
    parts = gitid.split("+")
    return tuple(parts[1:]) if parts[0] == GITID_PREFIX and len(parts) > 1 else ()


def patched_prefix() -> Path:
    return config.cache_dir() / "criu-bunshin"


def _stamp(source: str) -> str:
    h = hashlib.sha256(source.encode())
    for p in patches():
        h.update(p.name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def is_current(prefix: Path | None = None) -> bool:
    """Whether ``prefix`` holds a build of the current patches (read from its stamp)."""
    prefix = Path(prefix) if prefix is not None else patched_prefix()
    try:
        source, stamp = (prefix / "stamp").read_text().split()
    except (OSError, ValueError):
        return False
    return ((prefix / "bin" / "criu").is_file() and (prefix / _SITE / "pycriu").is_dir()
            and stamp == _stamp(source))


def _run(argv: list[str], cwd: Path, log_file: Path) -> None:
    with open(log_file, "ab") as out:
        p = subprocess.run(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-15:])
        raise UnsupportedKernel(
            f"building CRIU: `{' '.join(argv)[:120]}` failed (exit {p.returncode}):\n{tail}\n"
            f"CRIU's build needs these Debian packages: {' '.join(BUILD_DEPS)}")


def _fetch_source(stage: Path, suite: str) -> Path:
    from .criu_locate import _KEYRING, _DEBIAN_MIRROR, _apt_options, _sh

    apt_root, src = stage / "apt", stage / "src"
    for d in (apt_root / "lists/partial", apt_root / "cache/archives/partial", src):
        d.mkdir(parents=True)
    (apt_root / "sources.list").write_text(
        f"deb-src [signed-by={_KEYRING}] {_DEBIAN_MIRROR} {suite} main\n")
    opts = _apt_options(apt_root)
    _sh(["apt-get", *opts, "-qq", "update"])
    _sh(["apt-get", *opts, "-qq", "source", "--download-only", "--tar-only", "criu"], cwd=src)
    tars = sorted(src.glob("criu_*.orig.tar.*"))
    if len(tars) != 1:
        raise UnsupportedKernel(f"building CRIU: apt fetched {[t.name for t in tars]} from {suite}, "
                                "not one criu_*.orig.tar")
    return tars[0]


def build_criu(prefix: Path | None = None, suite: str | None = None, jobs: int | None = None,
               stock: Path | None = None):
    """Fetch Debian ``suite``'s CRIU source, apply :func:`patches`, build it and install the
    binary into ``prefix`` (default :func:`patched_prefix`), swapped in only when complete;
    returns its :class:`~bunshin.criu_locate.CriuInfo`. The source must be the version of the
    stock private install at ``stock`` (default ``private_prefix()``), whose pycriu it takes."""
    from .criu_locate import DEFAULT_SUITE, inspect_criu, install_staged, private_prefix

    if not (shutil.which("apt-get") and shutil.which("make") and shutil.which("patch")):
        raise UnsupportedKernel("building CRIU needs apt-get (Debian or Ubuntu), make and patch")
    prefix = Path(prefix) if prefix is not None else patched_prefix()
    stock = Path(stock) if stock is not None else private_prefix()
    pycriu = stock / _SITE / "pycriu"
    if not (pycriu / "__init__.py").is_file():
        raise UnsupportedKernel(f"building CRIU: no pycriu at {pycriu}; the stock private CRIU "
                                "comes first: `bunshin criu provision`")
    major, minor, sub = inspect_criu(stock / "bin" / "criu", "private", check=False).version
    version = f"{major}.{minor}" + (f".{sub}" if sub else "")  # as CRIU's releases are named

    def make(stage: Path) -> None:
        tar = _fetch_source(stage, suite or DEFAULT_SUITE)
        if not tar.name.startswith(f"criu_{version}."):
            raise UnsupportedKernel(f"building CRIU: Debian's source is {tar.name}, the stock CRIU "
                                    f"(and its pycriu) {version}: provision both again "
                                    "(`bunshin criu provision`)")
        with tarfile.open(tar) as tf:
            # the "data" filter (no absolute paths, links out, devices) is Python >= 3.11.4's
            if hasattr(tarfile, "data_filter"):
                tf.extractall(stage / "src", filter="data")
            else:
                tf.extractall(stage / "src")  # noqa: S202 - apt checked the archive's digest
        tree = next(d for d in (stage / "src").iterdir() if d.is_dir())
        build_log = stage / "build.log"
        for p in patches():
            _run(["patch", "-p1", "--forward", "--batch", "-i", str(p)], tree, build_log)
        gitid = "+".join([GITID_PREFIX, *patch_names()])
        _run(["make", f"-j{jobs or (os.cpu_count() or 1) + 1}", "criu", f"GITID={gitid}"],
             tree, build_log)
        (stage / "bin").mkdir()
        shutil.copy2(tree / "criu" / "criu", stage / "bin" / "criu")
        shutil.copytree(pycriu, stage / _SITE / "pycriu",
                        ignore=shutil.ignore_patterns("__pycache__"))
        (stage / "stamp").write_text(f"{tar.name} {_stamp(tar.name)}\n")
        shutil.rmtree(stage / "src")
        shutil.rmtree(stage / "apt")

    install_staged(prefix, make)
    info = inspect_criu(prefix / "bin" / "criu", "patched")
    log.info("built %s (patches %s): %s", info.path, ", ".join(info.patches), info.reason)
    return info
