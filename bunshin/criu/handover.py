"""How the workspace's external resources reach CRIU: the one seam between what is assembled
about them (:mod:`bunshin.criu.externals`, :mod:`bunshin.criu.initfds`) and a request's options.

The stock way (:class:`InheritFds`): on dump each is named in ``external`` (the control
socket's stand-in as ``unix[ino]``, host files as ``file[mnt:ino]``); on restore each is handed
back as a descriptor of the worker (``inherit_fd``). A CRIU plugin that dumps and restores them
itself replaces it with :func:`use`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from . import externals


class Handover(Protocol):
    def dump(self, opts: Any, stand_in_ino: int, exts: list[externals.External]) -> None:
        """Name the control socket's stand-in (its inode) and ``exts`` in a dump's ``opts``."""

    def restore(self, opts: Any, meta: dict, ctl_fd: int, log_file: Path) -> list[int]:
        """Hand the new control socket (``ctl_fd``, the worker's) and the image's externals
        (``meta``) to a restore's ``opts``; the descriptors to pass to the worker, which the
        caller closes once it ran."""


class InheritFds:
    """The stock way: ``external`` on dump, ``inherit_fd`` on restore."""

    def dump(self, opts: Any, stand_in_ino: int, exts: list[externals.External]) -> None:
        opts.external.append(f"unix[{stand_in_ino}]")
        opts.external.extend(e.key for e in exts)

    def restore(self, opts: Any, meta: dict, ctl_fd: int, log_file: Path) -> list[int]:
        opts.inherit_fd.add(key=f"socket:[{meta['ctl_socket_ino']}]", fd=ctl_fd)
        fds: list[int] = []
        try:
            for ext in meta["externals"]:
                fd = externals.reopen(ext, log_file)
                fds.append(fd)
                opts.inherit_fd.add(key=ext["key"], fd=fd)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds


_current: Handover = InheritFds()


def current() -> Handover:
    return _current


def use(handover: Handover) -> None:
    """Make ``handover`` the way every later dump and restore hands the externals over."""
    global _current
    _current = handover
