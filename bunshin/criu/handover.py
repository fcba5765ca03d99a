"""How the workspace's external resources reach CRIU: the one seam between what is assembled
about them (:mod:`bunshin.criu.externals`, :mod:`bunshin.criu.initfds`) and a request (its
``opts`` and the environment of its ``criu swrk`` worker).

The stock way (:class:`InheritFds`): on dump each is named in ``external`` (the control
socket's stand-in as ``unix[ino]``, host files as ``file[mnt:ino]``); on restore each is handed
back as a descriptor of the worker (``inherit_fd``). :class:`Plugin`, the default, has Bunshin's
CRIU plugin (:mod:`bunshin.criu.plugin`) claim them at the dump and hand them back on restore,
served by :class:`plugin.FdServer`: the control socket always, the host files with a CRIU built
with Bunshin's ``ext-files`` patch (a stock CRIU asks no plugin about a regular file: they go
the stock way there). The image records which way each went (``ctl_socket_by``, ``files_by``);
an image whose files the plugin took is restored by a stock CRIU too, with ``inherit_fd`` (the
keys are the same). :func:`use` puts another in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..errors import CheckpointError, ImageError
from . import externals, images, plugin, runner

log = logging.getLogger("bunshin.criu")

#: the patch of criu/patches with which CRIU asks the plugins about host files
FILES_PATCH = "ext-files"
#: the longest list of files named to the plugin (one environment string: Linux takes 128 KiB)
_ENV_MAX = 100_000


class Handover(Protocol):
    def dump(self, opts: Any, env: dict, stand_in_ino: int, exts: list[externals.External],
             info: Any) -> dict:
        """Name the control socket's stand-in (its inode) and ``exts`` in a dump's ``opts`` and
        its worker's ``env`` for ``info``'s CRIU; gives what took them, for the image's
        metadata (``ctl_socket_by``, ``files_by``: "plugin" or "inherit-fd")."""

    def dumped(self, criu: Path, taken_by: dict, exts: list[externals.External],
               info: Any) -> list[externals.External]:
        """After the dump into ``criu`` (CRIU's images; ``taken_by`` what :meth:`dump` gave):
        the externals to record for the restore; :class:`CheckpointError` for an image the
        restore could not be handed what it needs."""

    def restore(self, opts: Any, env: dict, meta: dict, ctl_fd: int, log_file: Path,
                layers: Sequence[str], criu: Path, info: Any
                ) -> contextlib.AbstractContextManager[list[int]]:
        """Around a restore's request to ``info``'s CRIU: hand the new control socket
        (``ctl_fd``) and the image's externals (``meta``, and CRIU's images at ``criu``; files
        of the workspace's own layers from the restored ``layers``) to its ``opts`` and its
        worker's ``env``; gives the descriptors to pass to the worker, closed on leaving."""


class InheritFds:
    """The stock way: ``external`` on dump, ``inherit_fd`` on restore."""

    def dump(self, opts: Any, env: dict, stand_in_ino: int, exts: list[externals.External],
             info: Any) -> dict:
        opts.external.append(f"unix[{stand_in_ino}]")
        opts.external.extend(e.key for e in exts)
        return {"ctl_socket_by": "inherit-fd", "files_by": "inherit-fd"}

    def dumped(self, criu: Path, taken_by: dict, exts: list[externals.External],
               info: Any) -> list[externals.External]:
        return exts  # CRIU took none but those named in external, by these keys

    @contextlib.contextmanager
    def restore(self, opts: Any, env: dict, meta: dict, ctl_fd: int, log_file: Path,
                layers: Sequence[str], criu: Path, info: Any) -> Iterator[list[int]]:
        opts.inherit_fd.add(key=f"socket:[{meta['ctl_socket_ino']}]", fd=ctl_fd)
        with _reopened(meta, log_file, layers) as files:
            for key, fd in files.items():
                opts.inherit_fd.add(key=key, fd=fd)
            yield list(files.values())


class Plugin(InheritFds):
    """By Bunshin's CRIU plugin (in the worker's environment: the plugin's directory; on dump
    what it claims, on restore :class:`plugin.FdServer`'s address); the stock way for what the
    plugin or the CRIU cannot take (the plugin missing, a stock CRIU's host files, an image
    dumped without it)."""

    def dump(self, opts: Any, env: dict, stand_in_ino: int, exts: list[externals.External],
             info: Any) -> dict:
        if not plugin.available():
            log.warning("Bunshin's CRIU plugin: %s; the workspace's externals are dumped the "
                        "stock way", plugin.plugin_info().reason)
            return super().dump(opts, env, stand_in_ino, exts, info)
        names = [e.devino for e in exts]
        files = FILES_PATCH in info.patches and len(" ".join(names)) <= _ENV_MAX
        if FILES_PATCH in info.patches and not files:
            log.warning("%d host files are too many to name to Bunshin's CRIU plugin: they are "
                        "dumped the stock way", len(exts))
        env.update(plugin.dump_options(stand_in_ino, names if files else None).worker_env())
        if not files:
            opts.external.extend(e.key for e in exts)
        return {"ctl_socket_by": "plugin", "files_by": "plugin" if files else "inherit-fd"}

    def dumped(self, criu: Path, taken_by: dict, exts: list[externals.External],
               info: Any) -> list[externals.External]:
        """The plugin claims host files by device and inode; CRIU records each under its own
        ``file[mnt:ino]``. A key the scan did not make (the file reached through another mount
        than the one the scan saw) is recorded as an alias of the scanned file of that inode;
        none: the dump fails here rather than its restore later."""
        if taken_by.get("files_by") != "plugin":
            return exts
        known = {e.key for e in exts}
        out = list(exts)
        for fid, key in sorted(images.external_files(criu, runner.pycriu(info)).items()):
            if key in known:
                continue
            ino = key.rstrip("]").rpartition(":")[2]
            same = [e for e in exts if e.devino.rpartition(":")[2] == str(int(ino, 16))]
            if not same:
                raise CheckpointError(f"CRIU recorded the host file {key} (id {fid}) that Bunshin "
                                      "did not find the workspace using; dump again")
            out.append(dataclasses.replace(same[0], key=key))
            known.add(key)
        return out

    @contextlib.contextmanager
    def restore(self, opts: Any, env: dict, meta: dict, ctl_fd: int, log_file: Path,
                layers: Sequence[str], criu: Path, info: Any) -> Iterator[list[int]]:
        if meta.get("ctl_socket_by") != "plugin":
            with super().restore(opts, env, meta, ctl_fd, log_file, layers, criu, info) as fds:
                yield fds
            return
        files_by_plugin = meta.get("files_by") == "plugin" and FILES_PATCH in info.patches
        with _reopened(meta, log_file, layers) as files:
            by_id: dict[int, int] = {}
            if files_by_plugin:
                for fid, key in images.external_files(criu, runner.pycriu(info)).items():
                    if key not in files:
                        raise ImageError(f"the image's external file {key} (id {fid}) is not "
                                         "among the host files its metadata names: make a new image")
                    by_id[fid] = files[key]
            else:  # the stock way; the same keys whichever way the dump took them
                for key, fd in files.items():
                    opts.inherit_fd.add(key=key, fd=fd)
            with plugin.FdServer({int(meta["ctl_socket_ino"]): ctl_fd}, by_id) as srv:
                env.update(srv.options().worker_env())
                try:
                    yield [] if files_by_plugin else list(files.values())
                except CheckpointError as e:
                    srv.explain(e)
                    raise


@contextlib.contextmanager
def _reopened(meta: dict, log_file: Path, layers: Sequence[str]) -> Iterator[dict[str, int]]:
    """The image's host files reopened: key -> fd; closed on leaving."""
    files: dict[str, int] = {}
    try:
        for ext in meta["externals"]:
            files[ext["key"]] = externals.reopen(ext, log_file, layers)
        yield files
    finally:
        for fd in files.values():
            os.close(fd)


_current: Handover = Plugin()


def current() -> Handover:
    return _current


def use(handover: Handover) -> None:
    """Make ``handover`` the way every later dump and restore hands the externals over."""
    global _current
    _current = handover
