"""The ``bunshin`` command (also ``python -m bunshin``).

Each subcommand is one row of :data:`COMMANDS`, ``name -> "module:function"``; the module is
imported only when its command runs. The function receives the parsed ``argparse.Namespace`` and
returns an exit status (None means 0). A module that wants options defines
``add_arguments(parser)``, called only when its command was chosen, so adding a command never
means editing another command's code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable
from typing import Any

from .errors import BunshinError

__all__ = ["COMMANDS", "main", "CommandUnavailable"]

COMMANDS: dict[str, str] = {
    "doctor": "bunshin.doctor:main",
    "criu": "bunshin.criu_locate:main",
    "gc": "bunshin.runtime.gc:main",
    "demo": "bunshin.demo:main",
    "rootfs": "bunshin.cli:_rootfs",
}
_HELP = {
    "doctor": "check what this kernel offers Bunshin (exit 1 if something needed is missing)",
    "criu": "find or privately provision CRIU >= 4",
    "gc": "remove what dead workspaces left behind",
    "demo": "fork a live workspace and show what it costs",
    "rootfs": "build root filesystems",
}


class CommandUnavailable(Exception):
    """The module behind a command is not part of this build (yet)."""


def _resolve(target: str) -> Callable[..., Any]:
    module, _, func = target.partition(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        # Only the target itself (or a parent package) missing means "not available"; a missing
        # import inside an existing module is a real bug and must surface.
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            raise CommandUnavailable(f"{module} is not in this build") from None
        raise
    fn = getattr(mod, func, None)
    if fn is None:
        raise CommandUnavailable(f"{module} has no function {func}()")
    return fn


def _rootfs_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="rootfs_cmd", metavar="{debian,show}", required=True)
    deb = sub.add_parser("debian", help="debootstrap a Debian root into the cache")
    deb.add_argument("--suite", default=None, help="Debian suite (default: the builder's)")
    show = sub.add_parser("show", help="what a rootfs resolves to: its layers and, for an image, the "
                          "Env, WorkingDir, User and command its workspaces get (JSON)")
    show.add_argument("rootfs", help="a directory, tar archive, OCI layout or 'debian:SUITE'")


def _rootfs(args: argparse.Namespace) -> int:
    if args.rootfs_cmd == "show":
        import json

        rfs = _resolve("bunshin.runtime.rootfs:resolve")(args.rootfs)
        print(json.dumps({"kind": rfs.kind, "source": rfs.source, "lowers": [str(p) for p in rfs.lowers],
                          "image": rfs.image.to_dict() if rfs.image is not None else None}, indent=2))
        return 0
    build = _resolve("bunshin.runtime.rootfs:build_debian")
    result = build(**({"suite": args.suite} if args.suite else {}))
    if result is not None:
        print(result)
    return 0


_LOCAL_ARGUMENTS = {"rootfs": _rootfs_arguments}


def _chosen(argv: list[str]) -> str | None:
    for tok in argv:
        if not tok.startswith("-"):
            return tok if tok in COMMANDS else None
    return None


def _parser(chosen: str | None) -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="bunshin", description="Fork live Linux workspaces.")
    parser.add_argument("--version", action="version", version=f"bunshin {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        p = sub.add_parser(name, help=_HELP.get(name), description=_HELP.get(name))
        if name != chosen:
            continue
        if name in _LOCAL_ARGUMENTS:
            _LOCAL_ARGUMENTS[name](p)
            continue
        try:
            add = getattr(importlib.import_module(COMMANDS[name].partition(":")[0]),
                          "add_arguments", None)
        except ModuleNotFoundError:
            add = None  # reported properly when the command is dispatched
        if add is not None:
            add(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``bunshin`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = _chosen(argv)
    parser = _parser(chosen)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
                        format="%(name)s: %(message)s")
    try:
        rc = _resolve(COMMANDS[args.command])(args)
    except CommandUnavailable as e:
        print(f"bunshin {args.command}: not available yet ({e})", file=sys.stderr)
        return 2
    except BunshinError as e:
        print(f"bunshin {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0 if rc is None else int(rc)
