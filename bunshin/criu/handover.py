"""How the workspace's external resources reach CRIU: the one seam between what is assembled
about them (:mod:`bunshin.criu.externals`, :mod:`bunshin.criu.initfds`) and a request (its
``opts`` and the environment of its ``criu swrk`` worker).

The stock way (:class:`InheritFds`): on dump each is named in ``external`` (the control
socket's stand-in as ``unix[ino]``, host files as ``file[mnt:ino]``); on restore each is handed
back as a descriptor of the worker (``inherit_fd``). :class:`PluginSocket`, the default, has
Bunshin's CRIU plugin (:mod:`bunshin.criu.plugin`) dump and restore the control socket and
hands the host files over the stock way (CRIU 4.2 has no hook for them). :func:`use` puts
another in place.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..errors import CheckpointError
from . import externals, plugin

log = logging.getLogger("bunshin.criu")


class Handover(Protocol):
    def dump(self, opts: Any, env: dict, stand_in_ino: int, exts: list[externals.External]) -> str:
        """Name the control socket's stand-in (its inode) and ``exts`` in a dump's ``opts`` and
        its worker's ``env``; what took the control socket, recorded in the image as
        ``ctl_socket_by`` for the restore."""

    def restore(self, opts: Any, env: dict, meta: dict, ctl_fd: int, log_file: Path,
                layers: Sequence[str] = ()) -> contextlib.AbstractContextManager[list[int]]:
        """Around a restore's request: hand the new control socket (``ctl_fd``) and the
        image's externals (``meta``; files of the workspace's own layers from the restored
        ``layers``) to its ``opts`` and its worker's ``env``; gives the descriptors to pass to
        the worker, closed on leaving."""


class InheritFds:
    """The stock way: ``external`` on dump, ``inherit_fd`` on restore."""

    def dump(self, opts: Any, env: dict, stand_in_ino: int, exts: list[externals.External]) -> str:
        opts.external.append(f"unix[{stand_in_ino}]")
        opts.external.extend(e.key for e in exts)
        return "inherit-fd"

    @contextlib.contextmanager
    def restore(self, opts: Any, env: dict, meta: dict, ctl_fd: int, log_file: Path,
                layers: Sequence[str] = ()) -> Iterator[list[int]]:
        opts.inherit_fd.add(key=f"socket:[{meta['ctl_socket_ino']}]", fd=ctl_fd)
        with _host_files(opts, meta, log_file, layers) as fds:
            yield fds


class PluginSocket(InheritFds):
    """The control socket by Bunshin's CRIU plugin (in the worker's environment: the plugin's
    directory, and the socket's inode on dump, :class:`plugin.FdServer`'s address on restore);
    the stock way when the plugin is missing (dump) or the image was dumped without it
    (restore)."""

    def dump(self, opts: Any, env: dict, stand_in_ino: int, exts: list[externals.External]) -> str:
        if not plugin.available():
            log.warning("Bunshin's CRIU plugin: %s; the control socket is dumped as an external",
                        plugin.plugin_info().reason)
            return super().dump(opts, env, stand_in_ino, exts)
        env.update(plugin.dump_options(stand_in_ino).worker_env())
        opts.external.extend(e.key for e in exts)
        return "plugin"

    @contextlib.contextmanager
    def restore(self, opts: Any, env: dict, meta: dict, ctl_fd: int, log_file: Path,
                layers: Sequence[str] = ()) -> Iterator[list[int]]:
        if meta.get("ctl_socket_by") != "plugin":
            with super().restore(opts, env, meta, ctl_fd, log_file, layers) as fds:
                yield fds
            return
        with plugin.FdServer({int(meta["ctl_socket_ino"]): ctl_fd}) as srv:
            env.update(srv.options().worker_env())
            with _host_files(opts, meta, log_file, layers) as fds:
                try:
                    yield fds
                except CheckpointError as e:
                    srv.explain(e)
                    raise


@contextlib.contextmanager
def _host_files(opts: Any, meta: dict, log_file: Path, layers: Sequence[str]) -> Iterator[list[int]]:
    """The image's host files reopened and named in ``inherit_fd``; closed on leaving."""
    fds: list[int] = []
    try:
        for ext in meta["externals"]:
            fd = externals.reopen(ext, log_file, layers)
            fds.append(fd)
            opts.inherit_fd.add(key=ext["key"], fd=fd)
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


_current: Handover = PluginSocket()


def current() -> Handover:
    return _current


def use(handover: Handover) -> None:
    """Make ``handover`` the way every later dump and restore hands the externals over."""
    global _current
    _current = handover
