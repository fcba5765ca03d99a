"""Files a workspace's processes hold that live outside its mount namespace.

The init was exec'd from the host (its binary and libraries are host files) and its stdio are
the host's ``/dev/null`` and the workspace's ``init.log``; ``ws.spawn`` gives processes the
host's ``/dev/null``. CRIU cannot resolve such files inside the workspace, so each is dumped as
an external ``file[mnt_id:inode]`` (claimed by Bunshin's CRIU plugin, or named in ``external``
by a stock CRIU) and recorded here with what to hand back on restore (by the plugin, or in
``inherit_fd``; :mod:`bunshin.criu.handover`): the same host path (checked unchanged for mapped
files), or the restored workspace's own ``init.log``. A file mapped from one of the workspace's own overlay layers
(a program of its rootfs, or one it built) is such a file too: overlayfs maps the layer's
file, on a mount outside the workspace (the layer's, or its idmapped view in a sandbox). It is
recorded by its layer (counted from the bottom: the restored overlay has as many) and handed
back from the restored layer, not from the host's file of that name.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import ImageError


@dataclass
class External:
    key: str        # CRIU's id: file[mnt_id:inode] in hex
    path: str       # host path at dump time
    role: str       # "log" | "device" | "file" | "layer"
    flags: int      # open flags of an fd using it (O_RDONLY for mappings only)
    size: int       # size of a regular file at dump time
    layer: int = -1  # "layer": which of the workspace's layers holds it, counted from the bottom
    devino: str = ""  # "DEV:INO" as fstat() gives them: what Bunshin's CRIU plugin claims

    def to_dict(self) -> dict:
        return asdict(self)


def _mnt_id(fdinfo_path: str) -> int:
    with open(fdinfo_path) as fh:
        for line in fh:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    return -1


def _flags(fdinfo_path: str) -> int:
    with open(fdinfo_path) as fh:
        for line in fh:
            if line.startswith("flags:"):
                return int(line.split()[1], 8)
    return os.O_RDONLY


def _layer_of(st: os.stat_result, path: str, layers: Sequence[Path]) -> int:
    """Which of ``layers`` (topmost first) holds the file ``st`` at ``path``, counted from the
    bottom; -1 for none."""
    for i, layer in enumerate(layers):
        try:
            lst = os.lstat(os.path.join(layer, path.lstrip("/")))
        except OSError:
            continue
        # the overlay shows the layer's inode number, but a device number of its own
        if (lst.st_ino, lst.st_size, lst.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns):
            return len(layers) - 1 - i
    return -1


def scan(init_pid: int, pids: list[int], ws_dir: Path, layers: Sequence[Path] = ()) -> list[External]:
    """Every file (fd, mapping, executable) of ``pids`` not on a mount of the workspace's;
    ``layers`` are the workspace's overlay layers, topmost first (its upper the first)."""
    from .. import config

    with open(f"/proc/{init_pid}/mountinfo") as fh:
        inside = {int(ln.split()[0]) for ln in fh}
    state = str(config.state_dir()) + "/"  # a fork's init keeps its first ancestor's log
    found: dict[str, External] = {}

    def note(mnt: int, st: os.stat_result, path: str, flags: int | None) -> None:
        if mnt in inside or mnt < 0 or not path.startswith("/") or path.endswith(" (deleted)"):
            return
        key = f"file[{mnt:x}:{st.st_ino:x}]"
        if path == str(ws_dir / "init.log") or (path.startswith(state) and path.endswith("/init.log")):
            role = "log"
        elif stat.S_ISCHR(st.st_mode):
            role = "device"
        else:
            role = "file"
        layer = _layer_of(st, path, layers) if role == "file" else -1
        old = found.get(key)
        if old is None:
            found[key] = External(key, path, "layer" if layer >= 0 else role,
                                  os.O_RDONLY if flags is None else flags,
                                  st.st_size if stat.S_ISREG(st.st_mode) else 0, layer,
                                  f"{st.st_dev}:{st.st_ino}")
        elif flags is not None and (flags & os.O_ACCMODE) != os.O_RDONLY:
            old.flags = flags

    for pid in pids:
        base = f"/proc/{pid}"
        for name in os.listdir(f"{base}/fd"):
            try:
                path = os.readlink(f"{base}/fd/{name}")
                st = os.stat(f"{base}/fd/{name}")
                note(_mnt_id(f"{base}/fdinfo/{name}"), st, path, _flags(f"{base}/fdinfo/{name}"))
            except OSError:
                continue
        for mapped in [*os.listdir(f"{base}/map_files"), None]:
            link = f"{base}/map_files/{mapped}" if mapped else f"{base}/exe"
            try:
                fd = os.open(link, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                note(_mnt_id(f"/proc/self/fdinfo/{fd}"), os.fstat(fd), os.readlink(link), None)
            finally:
                os.close(fd)
    return list(found.values())


def reopen(ext: dict, log_file: Path, layers: Sequence[str] = ()) -> int:
    """An fd to hand CRIU for ``ext`` (a dict from the metadata) in a restored workspace whose
    overlay layers are ``layers`` (topmost first)."""
    keep = os.O_ACCMODE | os.O_APPEND
    if ext["role"] == "log":
        return os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    path = ext["path"]
    if ext["role"] == "layer":
        path = os.path.join(layers[len(layers) - 1 - ext["layer"]], path.lstrip("/"))
    try:
        fd = os.open(path, (ext["flags"] & keep) | os.O_CLOEXEC)
    except OSError as e:
        raise ImageError(f"the image uses the host file {ext['path']} ({ext['role']}): {e.strerror}") from None
    st = os.fstat(fd)
    if ext["role"] in ("file", "layer") and stat.S_ISREG(st.st_mode) and st.st_size != ext["size"]:
        os.close(fd)
        raise ImageError(f"the host file {ext['path']} changed since the image was made "
                         f"({ext['size']} -> {st.st_size} bytes; e.g. bunshin-init was rebuilt): "
                         "make a new image")
    return fd
