"""Finding a CRIU that works on this kernel, and provisioning a private one.

Search order: ``$BUNSHIN_CRIU`` (a path; if set, nothing else is tried), then Bunshin's patched
build (:mod:`bunshin.criu_build`, ``config.cache_dir()/criu-bunshin/bin/criu``), then the private
stock install at ``config.cache_dir()/criu/bin/criu``, then ``criu`` on ``PATH``. CRIU 3.x is refused: it cannot
dump on kernels >= 6.13 because of the vdso layout; CRIU 4.0-4.1 works but cannot dump TCP/UDP
sockets on kernels >= 6.16 (checkpoint-restore/criu#2705, fixed in 4.2): such a CRIU is used, and
its ``reason`` says so. :func:`provision_criu` installs Debian testing's (forky) CRIU 4.2 (with its
own loader and libraries, so the host's glibc does not matter) into a private prefix without
touching apt's system configuration. CRIU is asked everything through pycriu's RPC
(:mod:`bunshin.criu_rpc`): its version, its ``CHECK``, and later its dumps and restores.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from . import config, criu_rpc
from .criu_build import patches_in
from .errors import CriuError, UnsupportedKernel

__all__ = ["CriuInfo", "find_criu", "require_criu", "provision_criu", "MIN_VERSION",
           "add_arguments", "main"]

log = logging.getLogger("bunshin.criu")

MIN_VERSION = (4, 0, 0)
INET_FIXED = (4, 2, 0)  # CRIU < 4.2 fails on inet sockets on Linux >= 6.16 (criu#2705)
DEFAULT_SUITE = "forky"  # Debian testing: CRIU 4.2.1 (trixie, Debian 13, has 4.1.1)
_REFUSED_3X = (
    "CRIU 3.x fails on kernels ≥ 6.13 (vdso layout); "
    "provision a private CRIU 4: `bunshin criu provision`"
)
_DEBIAN_MIRROR = "http://deb.debian.org/debian"
_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
_LIBDIRS = ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu")


@dataclasses.dataclass(frozen=True)
class CriuInfo:
    """A CRIU binary found on this machine and whether Bunshin may use it.

    Bunshin drives CRIU through pycriu's RPC (:mod:`bunshin.criu_rpc`), and asks it so here too:
    its version (``VERSION``) and ``check_ok``, the verdict of its ``CHECK`` (None when it was
    not run, e.g. the binary was refused); ``check_output`` is its last lines. ``pycriu`` is
    the directory pycriu was imported from, ``pycriu_version`` its version ("" when none could
    be). ``plugins`` names the Bunshin CRIU plugins its requests load (``libdir``, see
    :mod:`bunshin.criu.plugin`), ``patches`` the Bunshin patches that CRIU was built with;
    both empty: a stock CRIU, used as it is.
    """

    path: str
    version: tuple[int, int, int]
    usable: bool
    reason: str
    source: str = "PATH"
    check_ok: bool | None = None
    check_output: str = ""
    pycriu: str | None = None
    pycriu_version: str = ""
    plugins: tuple[str, ...] = ()
    patches: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, d: dict) -> CriuInfo:
        """Rebuild from :func:`dataclasses.asdict` output (as stored in JSON); ``KeyError`` for
        one stored before CRIU was driven by RPC (kerndat then asks again)."""
        d["pycriu_version"]  # noqa: B018 - absent from the older form
        return cls(**{**d, "version": tuple(d["version"]), "plugins": tuple(d["plugins"]),
                      "patches": tuple(d["patches"])})

    def describe_driver(self) -> str:
        """How Bunshin speaks to this CRIU, for ``bunshin doctor`` and ``bunshin criu which``."""
        if not self.pycriu_version:
            return f"RPC (criu swrk) through pycriu: none usable{f' at {self.pycriu}' if self.pycriu else ''}"
        return f"RPC (criu swrk) through pycriu {self.pycriu_version} ({self.pycriu})"

    def describe_build(self) -> str:
        """Which Bunshin plugins and patches this CRIU carries; plainly a stock one otherwise."""
        if not (self.plugins or self.patches):
            return "stock CRIU: no Bunshin plugin, no patches (it works without them)"
        if not self.patches:
            return (f"plugins: {', '.join(self.plugins)}; patches: none — a stock CRIU: the "
                    "workspace's host files go by external/inherit_fd (`bunshin criu provision` "
                    "builds the patched one)")
        return (f"plugins: {', '.join(self.plugins) or 'none'}; "
                f"patches: {', '.join(self.patches)}")


def private_prefix() -> Path:
    """Where :func:`provision_criu` installs by default."""
    return config.cache_dir() / "criu"


def candidate() -> tuple[Path, str] | None:
    """The CRIU that :func:`find_criu` would examine, and where it came from; runs nothing.

    Raises :class:`UnsupportedKernel` when ``$BUNSHIN_CRIU`` names something not executable.
    """
    env = config.criu_path()
    if env:
        p = Path(env)
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise CriuError(
                f"BUNSHIN_CRIU={env!r} is not an executable file; point it at a CRIU >= 4 "
                "binary, or unset it and run `bunshin criu provision`"
            )
        return p, "BUNSHIN_CRIU"
    from .criu_build import patched_prefix

    for path, source in ((patched_prefix() / "bin" / "criu", "patched"),
                         (private_prefix() / "bin" / "criu", "private")):
        if path.is_file() and os.access(path, os.X_OK):
            return path, source
    found = shutil.which("criu")
    return (Path(found), "PATH") if found else None


def inspect_criu(path: Path, source: str = "PATH", check: bool = True) -> CriuInfo:
    """Ask the CRIU at ``path`` (RPC, ``criu swrk``) for its version; if new enough and
    ``check``, for its ``CHECK`` verdict."""
    dirs = criu_rpc.pycriu_dirs(path, private_prefix())
    if not dirs:
        return CriuInfo(str(path), (0, 0, 0), False,
                        "no pycriu found (Bunshin drives CRIU through it): `bunshin criu "
                        "provision` installs CRIU with its pycriu", source)
    try:
        mod = criu_rpc.pycriu(dirs[0])
    except CriuError as e:
        return CriuInfo(str(path), (0, 0, 0), False, str(e), source, pycriu=str(dirs[0]))
    from .criu.plugin import plugin_info

    p = plugin_info()
    here = CriuInfo(str(path), (0, 0, 0), False, "", source,
                    pycriu=str(Path(str(mod.__file__)).parent.parent),
                    pycriu_version=str(getattr(mod, "__version__", "?")),
                    plugins=(p.describe(),) if p.present else ())
    rpc = mod.rpc
    with criu_rpc.Swrk(str(path), mod, env=criu_rpc.worker_env(), timeout=30) as w:
        try:
            resp = w.ask(rpc.criu_req(type=rpc.VERSION, keep_open=True))
        except (OSError, EOFError) as e:
            return dataclasses.replace(here, reason=f"`{path} swrk` did not answer a VERSION "
                                                    f"request ({e}): {w.output(200)!r}")
        if not resp.success:
            return dataclasses.replace(here, reason=f"`{path} swrk` refused a VERSION request: "
                                                    f"{resp.cr_errmsg!r}")
        v = resp.version
        version = (v.major_number, v.minor_number, v.sublevel if v.HasField("sublevel") else 0)
        here = dataclasses.replace(here, patches=patches_in(v.gitid if v.HasField("gitid") else ""))
        if version < MIN_VERSION:
            return dataclasses.replace(here, version=version, reason=_REFUSED_3X)
        if not check:
            return dataclasses.replace(here, version=version, usable=True,
                                       reason="version ok; CHECK not run")
        try:
            w.client().check()
            ok, why = True, ""
        except mod.CRIUException as e:
            ok, why = False, str(e)
        tail = "\n".join(w.output().splitlines()[-5:])
    reason = "CHECK: looks good" if ok else f"CHECK failed ({why}): {tail}"
    if ok and version < INET_FIXED and _kernel() >= (6, 16):
        reason += ("; but CRIU < 4.2 cannot dump TCP/UDP sockets on Linux >= 6.16 (criu#2705): "
                   "`bunshin criu provision` installs 4.2")
    return dataclasses.replace(here, version=version, usable=ok, reason=reason, check_ok=ok,
                               check_output=tail)


def plugin_key() -> str:
    """What :func:`inspect_criu` reads of Bunshin's CRIU plugin changes with: its file (the
    one :func:`bunshin.criu.plugin.libdir` names, found without importing :mod:`bunshin.criu`,
    which takes ~0.2 s)."""
    try:
        from ._core import _syscalls

        path = Path(_syscalls.__file__).with_name("criu-plugins") / "bunshin.so"
        return f"{path}:{path.stat().st_mtime_ns}"
    except (ImportError, OSError) as e:
        return f"none: {e}"


def _kernel() -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return (int(m[1]), int(m[2])) if m else (0, 0)


def find_criu(check: bool = True) -> CriuInfo | None:
    """Locate CRIU (``$BUNSHIN_CRIU``, private install, ``PATH``) and judge it; None if none exists.

    A found but refused CRIU (3.x, or its ``CHECK`` request fails) comes back with ``usable=False`` and
    the reason. Raises :class:`UnsupportedKernel` when ``$BUNSHIN_CRIU`` is set but not executable.
    """
    cand = candidate()
    if cand is None:
        return None
    return inspect_criu(cand[0], cand[1], check=check)


def require_criu() -> CriuInfo:
    """Like :func:`find_criu` but raises :class:`CriuError` unless CRIU is usable."""
    info = find_criu()
    if info is None:
        raise CriuError("no CRIU found; run `bunshin criu provision` for a private CRIU 4")
    if not info.usable:
        raise CriuError(f"CRIU {'.'.join(map(str, info.version))} at {info.path} "
                        f"refused: {info.reason}")
    return info


def _apt_options(root: Path) -> list[str]:
    # Every path apt would read or write is redirected under root; nothing in /etc or /var changes.
    return [
        "-o", f"Dir::Etc::SourceList={root / 'sources.list'}",
        "-o", "Dir::Etc::SourceParts=/dev/null",
        "-o", f"Dir::State::Lists={root / 'lists'}",
        "-o", f"Dir::Cache={root / 'cache'}",
        "-o", "Dir::State::status=/dev/null",
        "-o", "APT::Architecture=amd64",
        "-o", "Debug::NoLocking=1",
    ]


def _sh(argv: list[str], cwd: Path | None = None) -> str:
    p = subprocess.run(argv, capture_output=True, text=True, cwd=cwd)
    if p.returncode != 0:
        shown = " ".join(a for a in argv if not a.startswith(("-o", "Dir::", "APT::", "Debug::")))
        raise UnsupportedKernel(
            f"CRIU provisioning: `{shown[:120]}` failed (exit {p.returncode}): "
            f"{p.stderr.strip()[-400:]}; check the suite name and that deb.debian.org is reachable"
        )
    return p.stdout


def _stage_install(stage: Path, prefix: Path, suite: str) -> None:
    apt_root, debs, sysroot = stage / "apt", stage / "debs", stage / "sysroot"
    for d in (apt_root / "lists/partial", apt_root / "cache/archives/partial", debs, sysroot,
              stage / "bin"):
        d.mkdir(parents=True)
    (apt_root / "sources.list").write_text(
        f"deb [signed-by={_KEYRING}] {_DEBIAN_MIRROR} {suite} main\n")
    opts = _apt_options(apt_root)
    _sh(["apt-get", *opts, "-qq", "update"])
    # Let apt resolve criu's shared-library closure against the private lists; virtual
    # packages come out as <name> and are skipped.
    out = _sh(["apt-cache", *opts, "depends", "--recurse", "--no-recommends", "--no-suggests",
               "--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances", "criu"])
    pkgs = sorted({ln for ln in out.splitlines() if re.match(r"^[a-z0-9]", ln)})
    # pycriu without its dependencies: python3-protobuf there targets Debian's own Python.
    _sh(["apt-get", *opts, "-qq", "download", *pkgs, "python3-pycriu"], cwd=debs)
    for deb in sorted(debs.glob("*.deb")):
        _sh(["dpkg-deb", "-x", str(deb), str(sysroot)])
    final = prefix / "sysroot"  # paths in the wrapper must name where it will live
    libpath = ":".join(str(final / d) for d in _LIBDIRS)
    wrapper = stage / "bin" / "criu"
    wrapper.write_text(
        "#!/bin/sh\n# Debian's CRIU with its own loader and libraries (written by Bunshin).\n"
        f'exec "{final / _LIBDIRS[0]}/ld-linux-x86-64.so.2" --library-path "{libpath}" '
        f'"{final}/usr/sbin/criu" "$@"\n')
    wrapper.chmod(0o755)
    shutil.rmtree(debs)
    shutil.rmtree(apt_root / "cache", ignore_errors=True)


def install_staged(prefix: Path, make: Callable[[Path], None]) -> None:
    """``make(stage)`` fills a stage directory beside ``prefix``, which then replaces
    ``prefix``; a failure removes the stage and leaves ``prefix`` as it was."""
    stage = prefix.with_name(prefix.name + ".new")
    shutil.rmtree(stage, ignore_errors=True)
    try:
        make(stage)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    old = prefix.with_name(prefix.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if prefix.exists():
        prefix.rename(old)
    stage.rename(prefix)
    shutil.rmtree(old, ignore_errors=True)


def provision_criu(prefix: Path | None = None, suite: str = DEFAULT_SUITE) -> CriuInfo:
    """Install Debian ``suite``'s CRIU (and python3-pycriu) privately into ``prefix``.

    ``prefix`` defaults to ``config.cache_dir()/criu``; the result is ``prefix/bin/criu``, a
    wrapper that runs the packaged binary with the packaged loader and libraries. The install is
    built next to ``prefix`` and swapped in only when complete. Needs ``apt-get``, ``dpkg-deb``
    and Debian's archive keyring; downloads from deb.debian.org.
    """
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb") and _KEYRING.is_file()):
        raise UnsupportedKernel(
            f"CRIU provisioning needs apt-get, dpkg-deb and {_KEYRING} (Debian or Ubuntu host); "
            "elsewhere install CRIU >= 4 yourself and set BUNSHIN_CRIU to its path"
        )
    prefix = Path(prefix) if prefix is not None else private_prefix()
    install_staged(prefix, lambda stage: _stage_install(stage, prefix, suite))
    info = inspect_criu(prefix / "bin" / "criu", "private")
    log.info("provisioned %s: %s", info.path, info.reason)
    return info


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Subcommands of ``bunshin criu``."""
    sub = parser.add_subparsers(dest="criu_cmd", metavar="{which,provision}", required=True)
    sub.add_parser("which", help="show the CRIU Bunshin would use and whether it is usable")
    prov = sub.add_parser("provision", help="install Debian's CRIU 4 privately (no apt changes) "
                                            "and build Bunshin's patched CRIU from its source")
    prov.add_argument("--prefix", type=Path, default=None,
                      help=f"install the stock CRIU here (default {private_prefix()})")
    prov.add_argument("--suite", default=DEFAULT_SUITE,
                      help="Debian suite to take CRIU from (trixie has 4.1.1: no inet sockets on Linux >= 6.16)")
    prov.add_argument("--stock-only", action="store_true",
                      help="do not build the patched CRIU (its build needs CRIU's build dependencies)")
    prov.add_argument("--if-needed", action="store_true",
                      help="only what is missing or stale (make install); what fails is a warning")


def _describe(info: CriuInfo) -> str:
    return "\n".join([f"path:    {info.path} ({info.source})",
                      f"version: {'.'.join(map(str, info.version))}",
                      f"driver:  {info.describe_driver()}",
                      f"build:   {info.describe_build()}",
                      f"usable:  {'yes' if info.usable else 'no'} — {info.reason}"])


def _provision(args: argparse.Namespace) -> CriuInfo | None:
    """``bunshin criu provision``: the stock CRIU, then Bunshin's build; None when
    ``--if-needed`` could not provision a stock CRIU (said on stderr)."""
    from .criu_build import build_criu, is_current

    stock = Path(args.prefix) if args.prefix is not None else private_prefix()
    if not (args.if_needed and (stock / "bin" / "criu").is_file()
            and inspect_criu(stock / "bin" / "criu", "private").usable):
        try:
            provision_criu(args.prefix, suite=args.suite)
        except UnsupportedKernel as e:
            if not args.if_needed:
                raise
            print(f"bunshin criu provision: no private CRIU ({e}); bunshin.criu's tests will skip",
                  file=sys.stderr)
            return None
    if not args.stock_only and not (args.if_needed and is_current()):
        try:
            build_criu(suite=args.suite, stock=stock)
        except Exception as e:  # noqa: BLE001 - with --if-needed, any failure is said and passed
            if not args.if_needed:
                raise
            # tests/test_criu_plugin.py fails on a stock CRIU: a missing build shows there
            print(f"bunshin criu provision: Bunshin's CRIU was not built ({e}); the stock CRIU "
                  "is used", file=sys.stderr)
    return find_criu()


def main(args: argparse.Namespace) -> int:
    """Run ``bunshin criu which|provision``; 0 when a usable CRIU results, else 1."""
    if args.criu_cmd == "provision":
        info: CriuInfo | None = _provision(args)
        if info is None:
            return 0
    else:
        info = find_criu()
    if info is None:
        print("no CRIU found; run `bunshin criu provision` for a private CRIU 4")
        return 1
    print(_describe(info))
    return 0 if info.usable else 1
