"""Bunshin's CRIU plugin (``criu/bunshin_plugin.c``, installed as
``bunshin/_core/criu-plugins/bunshin.so``): the workspace's control socket and host files are
dumped and restored by CRIU's plugin hooks instead of ``external`` / ``inherit_fd``.

At a dump the plugin claims the socket whose inode is in ``BUNSHIN_CRIU_CTL_INO`` (the
unix-socket hooks) and the host files whose ``DEV:INO`` are in ``BUNSHIN_CRIU_FILES`` (the
external-file hooks, which CRIU calls for a regular file on a mount outside the tree only when
built with Bunshin's ``ext-files`` patch, :mod:`bunshin.criu_build`). At a restore it connects
to the unix socket named in ``BUNSHIN_CRIU_FDS``, where :class:`FdServer` hands it the new
control socket and the reopened host files (``SCM_RIGHTS``; files by the ids CRIU gave them),
and gives each to CRIU when asked. The shells' pty masters are not externals: they are handed
into the init for the dump (``initfds.py``), so CRIU dumps each terminal whole. What a request
needs is an :class:`Options`: the environment of its ``criu swrk`` worker
(:meth:`Options.worker_env`), where CRIU finds the plugin's directory and the plugin its
variables; see :class:`bunshin.criu.handover.Plugin`.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError, CriuError

FILE_NAME = "bunshin.so"
ENV_CTL_INO = "BUNSHIN_CRIU_CTL_INO"
ENV_FDS = "BUNSHIN_CRIU_FDS"
ENV_FILES = "BUNSHIN_CRIU_FILES"
#: where CRIU looks for plugins when it was given no directory (criu/plugin.c): RPC has no
#: option for it, so a request's worker has it in its environment
ENV_LIBDIR = "CRIU_LIBS_DIR"
_MAGIC = "bunshin-criu-fds 1"
#: fds in one message (the plugin's MAX_FDS; it takes MAX_HANDED = 4096 in all)
PER_MESSAGE = 64
MAX_HANDED = 4096
#: the most CRIU 4.2.1 accepts: its CRIU_PLUGIN_VERSION (0.2.0) and CR_PLUGIN_HOOK__MAX (the
#: plugin names 4, its own, so that a CRIU of fewer hooks loads it too)
ABI_VERSION = (0, 2, 0)
MAX_HOOKS = 13
_HOOK_NAMES = ("DUMP_UNIX_SK", "RESTORE_UNIX_SK", "DUMP_EXT_FILE", "RESTORE_EXT_FILE",
               "DUMP_EXT_MOUNT", "RESTORE_EXT_MOUNT", "DUMP_EXT_LINK", "HANDLE_DEVICE_VMA",
               "UPDATE_VMA_MAP", "RESUME_DEVICES_LATE", "PAUSE_DEVICES", "CHECKPOINT_DEVICES",
               "POST_FORKING")


def libdir() -> Path:
    """The directory CRIU loads plugins from (:data:`ENV_LIBDIR`): the package's own, which holds
    this plugin alone (CRIU loads every ``*.so`` there)."""
    from .._core import _syscalls

    return Path(_syscalls.__file__).with_name("criu-plugins")


@dataclass(frozen=True)
class PluginInfo:
    """The plugin this package would hand CRIU, as read from the built file."""

    path: str
    present: bool
    name: str = ""
    version: tuple[int, int, int] = (0, 0, 0)
    hooks: tuple[str, ...] = ()
    reason: str = ""

    def describe(self) -> str:
        if not self.present:
            return f"none ({self.reason})"
        v = ".".join(map(str, self.version))
        return f"{self.name} {self.path} (plugin ABI {v}; hooks {', '.join(self.hooks)})"


class _Desc(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("init", ctypes.c_void_p), ("exit", ctypes.c_void_p),
                ("version", ctypes.c_uint), ("max_hooks", ctypes.c_uint),
                ("hooks", ctypes.c_void_p * MAX_HOOKS)]


_info: PluginInfo | None = None


def plugin_info() -> PluginInfo:
    """Which plugin Bunshin hands CRIU, read from its descriptor (``CR_PLUGIN_DESC``): its
    name, ABI version and hooks; ``present`` is False (with the reason) when it is missing or
    is not one CRIU 4.2.1 would load. For ``bunshin doctor`` and ``bunshin criu which``."""
    global _info
    if _info is None:
        _info = _read_info(libdir() / FILE_NAME)
    return _info


def _read_info(path: Path) -> PluginInfo:
    if not path.is_file():
        return PluginInfo(str(path), False, reason=f"{path} is not built: reinstall bunshin (make install)")
    try:
        # RTLD_LAZY: the functions it takes from the criu binary are not looked up until called
        lib = ctypes.CDLL(str(path), mode=os.RTLD_LAZY | os.RTLD_LOCAL)
        d = _Desc.in_dll(lib, "CR_PLUGIN_DESC")
    except (OSError, ValueError) as e:
        return PluginInfo(str(path), False, reason=f"cannot read {path}: {e}")
    version = ((d.version >> 16) & 0xFF, (d.version >> 8) & 0xFF, d.version & 0xFF)
    hooks = tuple(n for n, h in zip(_HOOK_NAMES[:d.max_hooks], d.hooks) if h)  # CRIU reads no further
    name = (d.name or b"").decode()
    if version > ABI_VERSION or d.max_hooks > MAX_HOOKS:
        return PluginInfo(str(path), False, name, version, hooks,
                          f"plugin ABI {version}/{d.max_hooks} hooks is newer than CRIU 4.2.1's")
    return PluginInfo(str(path), True, name, version, hooks)


@dataclass
class Options:
    """What a CRIU request needs for the plugin: its directory and its worker's environment."""

    libdir: str
    env: dict[str, str] = field(default_factory=dict)

    def worker_env(self) -> dict[str, str]:
        """What to add to the ``criu swrk`` worker's environment."""
        return {**self.env, ENV_LIBDIR: self.libdir}


def require() -> PluginInfo:
    """The plugin, or :class:`CriuError` saying why it cannot be used."""
    info = plugin_info()
    if not info.present:
        raise CriuError(f"Bunshin's CRIU plugin: {info.reason}")
    return info


def available() -> bool:
    return plugin_info().present


def dump_options(ctl_ino: int, files: list[str] | None = None) -> Options:
    """A dump whose control socket (the init's end, inode ``ctl_ino``) the plugin claims, and
    the host files ``files`` ("DEV:INO" each; a CRIU with the ``ext-files`` patch asks)."""
    require()
    env = {ENV_CTL_INO: str(ctl_ino)}
    if files is not None:
        env[ENV_FILES] = " ".join(files)
    return Options(str(libdir()), env)


class FdServer:
    """Serves the fds of a restore to the plugin: a unix stream socket in a private (0700)
    directory, named to the plugin by :meth:`options`; one connection, messages of at most
    :data:`PER_MESSAGE` fds each, then the end of the stream.

    ``with FdServer({ino: fd}, {file_id: fd}) as srv: ask CRIU with srv.options()``;
    :attr:`served` says whether the plugin took them (:meth:`explain` words a failure when it
    did not).
    """

    def __init__(self, sockets: dict[int, int], files: dict[int, int] | None = None,
                 timeout: float = 300):
        self.sockets = sockets
        self.files = files or {}
        if len(self.sockets) + len(self.files) > MAX_HANDED:
            raise CheckpointError(f"a restore needs {len(self.sockets) + len(self.files)} "
                                  f"descriptors handed to CRIU; Bunshin's CRIU plugin takes "
                                  f"{MAX_HANDED}: end processes that hold many host files")
        self.timeout = timeout
        self.served = False
        self.error = ""
        self._dir = tempfile.mkdtemp(prefix="bunshin-criu-fds-")
        if len(os.path.join(self._dir, "fds").encode()) >= 108:  # sun_path's size; a long TMPDIR
            os.rmdir(self._dir)
            self._dir = tempfile.mkdtemp(prefix="bunshin-criu-fds-", dir="/tmp")
        self.address = os.path.join(self._dir, "fds")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def options(self) -> Options:
        require()
        return Options(str(libdir()), {ENV_FDS: self.address})

    def __enter__(self) -> FdServer:
        try:
            self._listener.bind(self.address)
            self._listener.listen(1)
            self._listener.settimeout(0.1)
        except BaseException:
            self._cleanup()
            raise
        self._thread = threading.Thread(target=self._serve, name="bunshin-criu-fds", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._cleanup()

    def _cleanup(self) -> None:
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _serve(self) -> None:
        import time

        deadline = time.monotonic() + self.timeout
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                self.error = f"accept: {e.strerror}"
                return
            with conn:
                # only a process of our own user may take the workspace's sockets
                uid = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                      ctypes.sizeof(ctypes.c_int) * 3)
                if int.from_bytes(uid[4:8], "little") != os.geteuid():
                    continue
                handed = ([(f"unix:{ino}", fd) for ino, fd in sorted(self.sockets.items())]
                          + [(f"file:{fid}", fd) for fid, fd in sorted(self.files.items())])
                try:
                    for i in range(0, len(handed), PER_MESSAGE):
                        part = handed[i:i + PER_MESSAGE]
                        body = " ".join([_MAGIC, *(tok for tok, _fd in part)]).encode()
                        socket.send_fds(conn, [body], [fd for _tok, fd in part])
                    conn.shutdown(socket.SHUT_WR)
                    self.served = True
                except OSError as e:
                    self.error = f"sendmsg: {e.strerror}"
                return

    def explain(self, e: CheckpointError) -> CheckpointError:
        """``e`` with a line saying the plugin never took the fds, if so."""
        if self.served:
            return e
        why = f" ({self.error})" if self.error else ""
        e.args = (f"{e}\n  Bunshin's CRIU plugin never took the restore's control socket and files from "
                  f"{self.address}{why}",)
        return e


__all__ = ["ABI_VERSION", "ENV_LIBDIR", "FdServer", "Options", "PluginInfo", "available", "dump_options",
           "libdir", "plugin_info", "require"]
