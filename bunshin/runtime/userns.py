"""A workspace's own user namespace (``isolation="sandbox"``).

The workspace's init is cloned into a new user namespace U (with its mount, pid, net, ipc,
uts and cgroup namespaces, which U therefore owns) whose ids 0-65535 are the host's ``BASE`` to
``BASE + 65535``: root inside is root of U only, and no id inside is a host id that owns
anything of the host. The forks of a workspace are made from its processes, so they are in U
too and their namespaces are U's.

Files: the rootfs's layers are seen through mounts idmapped with U (a file the host's uid 1000
owns is uid 1000 inside); the workspace's upper layer (and the frozen copies of it its forks
stack on) holds the shifted ids as they are, since overlayfs writes it with the ids the
workspace sees shifted. The overlay itself is mounted by the trainer (host root), as a fork's
is, and moved into the workspace by its init (REROOT). What the trainer writes into the upper
layer it gives the shifted owner (:func:`shift_tree`, :func:`give`).
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
import weakref
from pathlib import Path

from ..errors import IsolationError

__all__ = ["BASE", "CLONE_NEWUSER", "ISOLATIONS", "SIZE", "UserNs", "check", "give", "inside",
           "owner_inside", "shift_tree"]

BASE = 100000  # host id of the workspace's root (uid and gid)
SIZE = 65536  # ids mapped: 0-65535 inside
ISOLATIONS = ("trusted", "sandbox")
CLONE_NEWUSER = 0x10000000

_SYS_OPEN_TREE, _SYS_MOUNT_SETATTR = 428, 442
_OPEN_TREE_CLONE, _AT_EMPTY_PATH = 1, 0x1000
_MOUNT_ATTR_IDMAP = 0x00100000
_libc = ctypes.CDLL(None, use_errno=True)


def check(isolation: object) -> str:
    if isolation not in ISOLATIONS:
        raise IsolationError(f"isolation must be one of {', '.join(repr(i) for i in ISOLATIONS)} "
                             f"('sandbox': root inside has no power over the host; 'trusted': "
                             f"the workspace's root is the host's), got {isolation!r}")
    return str(isolation)


def _idmap_lines() -> str:
    return f"0 {BASE} {SIZE}\n"


class UserNs:
    """U, by descriptor, with the idmapped views of the rootfs's layers made so far (one per
    layer, shared by every overlay of the workspace and its forks). ``lowers``: the layers
    that hold host ids (the rootfs's own); the others (frozen copies of upper layers) hold
    ids already shifted."""

    def __init__(self, fd: int, lowers: tuple[Path, ...]) -> None:
        self.fd = fd
        self.lowers = frozenset(lowers)
        self._views: dict[Path, int] = {}
        self.lock = threading.Lock()
        self.pool = None  # its forks' namespace sets, made ahead (fork/nsmaker.py)
        self.users = 0  # bodies running in it (Body.__post_init__, Body._close)
        self.ino = os.fstat(fd).st_ino
        _live[self.ino] = self

    @classmethod
    def of_new_init(cls, pid: int, lowers: tuple[Path, ...]) -> UserNs:
        """U of ``pid``, a process just cloned into it and waiting for its maps: written here."""
        with open(f"/proc/{pid}/uid_map", "w") as f:
            f.write(_idmap_lines())
        with open(f"/proc/{pid}/gid_map", "w") as f:
            f.write(_idmap_lines())
        return cls(os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC), lowers)

    def layer(self, lower: Path) -> str:
        """The path overlayfs takes for ``lower`` in U's workspaces: its idmapped view (a
        detached mount, named through our descriptor of it) for a rootfs layer, else itself."""
        lower = Path(lower)
        if lower not in self.lowers:
            return str(lower)
        with self.lock:
            fd = self._views.get(lower)
            if fd is None:
                fd = self._views[lower] = _idmapped(lower, self.fd)
        return f"/proc/self/fd/{fd}"

    def layers(self, lowers) -> list[str]:
        return [self.layer(p) for p in lowers]

    @staticmethod
    def give_dirs(upper, work) -> None:
        """A new, empty upper layer: its top is the workspace's "/", owned by root inside
        (overlayfs works in the work directory as its mounter, the trainer)."""
        os.chown(upper, BASE, BASE)

    def acquire(self) -> None:
        with self.lock:
            self.users += 1

    def release(self) -> None:
        """A body in it closed; the last one takes its views and pool along."""
        with self.lock:
            self.users -= 1
            last = self.users == 0
        if last:
            self.close()

    def close(self) -> None:
        if _live.get(self.ino) is self:
            del _live[self.ino]
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()
        with self.lock:
            fds, self._views = list(self._views.values()), {}
            if self.fd >= 0:
                fds.append(self.fd)
                self.fd = -1
        for fd in fds:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit os may be gone
            pass


_live: weakref.WeakValueDictionary[int, UserNs] = weakref.WeakValueDictionary()


def live(ino: int) -> UserNs | None:
    """The UserNs of the user namespace whose inode is ``ino``, while a body runs in it."""
    return _live.get(ino)


def _idmapped(path: Path, userns_fd: int) -> int:
    """A detached copy of the mount at ``path`` whose ids are seen through ``userns_fd``."""
    fd = _libc.syscall(_SYS_OPEN_TREE, -100, os.fsencode(str(path)), _OPEN_TREE_CLONE | os.O_CLOEXEC)
    if fd < 0:
        e = ctypes.get_errno()
        raise IsolationError(f"cannot clone the mount of rootfs layer {path}: {os.strerror(e)}")
    attr = struct.pack("QQQQ", _MOUNT_ATTR_IDMAP, 0, 0, userns_fd)
    if _libc.syscall(_SYS_MOUNT_SETATTR, fd, b"", _AT_EMPTY_PATH, ctypes.c_char_p(attr), len(attr)) < 0:
        e = ctypes.get_errno()
        os.close(fd)
        raise IsolationError(f"cannot idmap rootfs layer {path} for a sandbox workspace "
                             f"({os.strerror(e)}): its file system must support idmapped mounts "
                             "(ext4, btrfs, xfs, tmpfs); use isolation='trusted' for it")
    return fd


def shifted(i: int) -> int:
    """The host id of id ``i`` inside (ids out of the range are left alone)."""
    return BASE + i if 0 <= i < SIZE else i


def give(fd: int) -> None:
    """A file the trainer just made in a sandbox workspace: owned by root inside."""
    os.fchown(fd, BASE, BASE)


def shift_tree(top: Path) -> None:
    """Every entry of ``top`` (a fresh upper layer the trainer prepared with host ids) given
    its shifted owner."""
    for dirpath, dirnames, filenames in os.walk(top):
        for name in [".", *dirnames, *filenames] if dirpath == str(top) else [*dirnames, *filenames]:
            p = os.path.join(dirpath, name) if name != "." else dirpath
            st = os.lstat(p)
            os.chown(p, shifted(st.st_uid), shifted(st.st_gid), follow_symlinks=False)
            if not os.path.islink(p):
                os.chmod(p, st.st_mode & 0o7777)  # chown clears set-id bits


_maps: dict[tuple[int, str], list[tuple[int, int, int]]] = {}
_maps_lock = threading.Lock()
_OVERFLOW = 65534  # what a user namespace shows for an id it does not map


_IDENTITY = [(0, 0, 1 << 32)]


def _extents(pid: int, kind: str) -> list[tuple[int, int, int]]:
    """``kind`` ("uid" or "gid") map of ``pid``'s user namespace: (first id inside, first
    host id, count) per line. The trainer's own needs no read; a sandbox's is kept by the
    namespace's inode (a number the kernel may give again once the namespace is gone: kept
    only when it is the one map every sandbox has)."""
    ino = os.stat(f"/proc/{pid}/ns/user").st_ino
    if ino == _own_ino():
        return _IDENTITY
    got = _maps.get((ino, kind))
    if got is None:
        with open(f"/proc/{pid}/{kind}_map") as f:
            got = [tuple(int(x) for x in line.split()) for line in f if line.strip()]  # type: ignore[misc]
        if got == [(0, BASE, SIZE)]:
            with _maps_lock:
                _maps[(ino, kind)] = got
    return got


def _own_ino() -> int:
    global _own
    if _own is None:
        _own = os.stat("/proc/self/ns/user").st_ino
    return _own


_own: int | None = None


def inside(pid: int, kind: str, ids) -> list[int]:
    """Host ``ids`` (what the trainer reads in /proc or stat) as ``pid``'s user namespace
    names them: what a system call made by that process (an injected one) must pass."""
    ext = _extents(pid, kind)
    out = []
    for i in ids:
        for first, host, count in ext:
            if host <= i < host + count:
                out.append(first + i - host)
                break
        else:
            out.append(_OVERFLOW)
    return out


def owner_inside(pid: int, st: os.stat_result) -> tuple[int, int]:
    """``st``'s owner as ``pid``'s user namespace names it (for an injected chown)."""
    return inside(pid, "uid", (st.st_uid,))[0], inside(pid, "gid", (st.st_gid,))[0]
