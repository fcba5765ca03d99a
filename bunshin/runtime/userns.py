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
import errno
import os
import struct
import threading
import weakref
from pathlib import Path

from ..errors import IsolationError

__all__ = ["BASE", "CLONE_NEWUSER", "ISOLATIONS", "SIZE", "UserNs", "check", "extents", "give",
           "inside", "owner_inside", "shift_tree"]

BASE = 100000  # host id of the workspace's root (uid and gid)
SIZE = 65536  # ids mapped: 0-65535 inside
ISOLATIONS = ("trusted", "sandbox")
CLONE_NEWUSER = 0x10000000

_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442
_OPEN_TREE_CLONE, _AT_EMPTY_PATH, _AT_FDCWD = 1, 0x1000, -100
_MOUNT_ATTR_IDMAP = 0x00100000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MS_BIND, _MS_UNBINDABLE = 0x1000, 0x20000
_MNT_DETACH = 2
VIEWS_DIR = "idmap"  # under the state directory: the attached views, one directory per UserNs

# Whether the idmapped views are attached (mounted under the state directory) rather than kept
# detached: None asks the kernel (kerndat: overlayfs of 6.1 refuses a detached layer); tests set
# True to take the attached path on a kernel that does not need it.
attach_views: bool | None = None
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
        self._views: dict[Path, str] = {}  # layer -> the path overlayfs takes for its view
        self._view_fds: list[int] = []  # the detached views
        self._attached: Path | None = None  # the directory the attached views are mounted in
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
        return cls.of(pid, lowers)

    @classmethod
    def of(cls, pid: int, lowers: tuple[Path, ...]) -> UserNs:
        """U of ``pid``, whose maps are written."""
        return cls(os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC), lowers)

    def layer(self, lower: Path) -> str:
        """The path overlayfs takes for ``lower`` in U's workspaces: its idmapped view for a
        rootfs layer, else itself. The view is a detached mount named through our descriptor
        of it, or, where overlayfs clones only mounts of the caller's mount namespace (6.1),
        that mount attached in the trainer's (:meth:`_attach`)."""
        lower = Path(lower)
        if lower not in self.lowers:
            return str(lower)
        with self.lock:
            view = self._views.get(lower)
            if view is None:
                fd = _idmapped(lower, self.fd)
                if _attaching():
                    view = self._attach(fd)
                else:
                    self._view_fds.append(fd)
                    view = f"/proc/self/fd/{fd}"
                self._views[lower] = view
        return view

    def _attach(self, fd: int) -> str:
        """The detached view ``fd`` mounted at ``<state>/idmap/<owner>-<U's inode>/<n>``
        (closed). That directory is a bind mount of its own, unbindable (so private): what is
        mounted in it propagates nowhere, and a recursive bind of the host's tree skips it.
        Its name says whose it is, so that ``bunshin gc`` removes it once its trainer died."""
        try:
            if self._attached is None:
                from .statedir import own_start_time

                top = views_root() / f"{os.getpid()}-{own_start_time()}-{self.ino}"
                top.mkdir(parents=True, exist_ok=True)
                try:
                    _mount(top, top, _MS_BIND)
                except IsolationError:
                    top.rmdir()
                    raise
                try:
                    _mount(None, top, _MS_UNBINDABLE)
                except IsolationError:
                    # Not kept: views mounted in it would propagate as its parent does.
                    _libc.umount2(os.fsencode(top), _MNT_DETACH)
                    top.rmdir()
                    raise
                self._attached = top
            where = self._attached / str(len(self._views))
            where.mkdir()
            if _libc.syscall(_SYS_MOVE_MOUNT, fd, b"", _AT_FDCWD, os.fsencode(where),
                             _MOVE_MOUNT_F_EMPTY_PATH) < 0:
                e = ctypes.get_errno()
                raise IsolationError(f"cannot mount an idmapped rootfs layer at {where}: "
                                     f"{os.strerror(e)}")
            return str(where)
        finally:
            os.close(fd)

    def layers(self, lowers) -> list[str]:
        return [self.layer(p) for p in lowers]

    def view_fds(self) -> list[int]:
        """Our descriptors of the detached views, which name them (``/proc/self/fd/N``) to a
        process that inherits them at the same numbers."""
        with self.lock:
            return list(self._view_fds)

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
            fds, self._view_fds, self._views = self._view_fds, [], {}
            attached, self._attached = self._attached, None
            if self.fd >= 0:
                fds.append(self.fd)
                self.fd = -1
        for fd in fds:
            os.close(fd)
        # overlayfs holds private clones of its layers: its mounts outlive these. A forked
        # copy of the trainer shares its mount namespace and leaves them to their maker.
        if attached is not None and attached.name.startswith(f"{os.getpid()}-"):
            remove_views(attached)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit os may be gone
            pass


_live: weakref.WeakValueDictionary[int, UserNs] = weakref.WeakValueDictionary()


def live(ino: int) -> UserNs | None:
    """The UserNs of the user namespace whose inode is ``ino``, while a body runs in it."""
    return _live.get(ino)


def _attaching() -> bool:
    if attach_views is not None:
        return attach_views
    from .. import kerndat

    return not kerndat.get().overlayfs_detached_layer


def views_root() -> Path:
    from .. import config

    return config.state_dir() / VIEWS_DIR


def _mount(source: Path | None, target: Path, flags: int) -> None:
    if _libc.mount(None if source is None else os.fsencode(source), os.fsencode(target), None,
                   flags, None) < 0:
        e = ctypes.get_errno()
        raise IsolationError(f"cannot mount {target} for the idmapped views of a sandbox "
                             f"workspace's rootfs layers: {os.strerror(e)}")


def remove_views(top: Path) -> None:
    """Unmount ``top`` (an attached views' directory) with every view in it, and remove it."""
    if _libc.umount2(os.fsencode(top), _MNT_DETACH) < 0 and ctypes.get_errno() != errno.EINVAL:
        e = ctypes.get_errno()
        raise OSError(e, f"cannot unmount {top}: {os.strerror(e)}")
    for sub in os.listdir(top):
        os.rmdir(top / sub)
    os.rmdir(top)


def dead_views() -> list[Path]:
    """The attached views' directories whose trainer is gone (named ``<pid>-<start>-<ino>``)."""
    from .statedir import proc_start_time

    root = views_root()
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        try:
            pid, start, _ = (int(x) for x in name.split("-"))
        except ValueError:
            continue
        if proc_start_time(pid) != start:
            out.append(root / name)
    return out


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
                             "(ext4, btrfs, xfs; tmpfs from Linux 6.3); use isolation='trusted' for it")
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


def extents(pid: int, kind: str) -> list[tuple[int, int, int]]:
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
    ext = extents(pid, kind)
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
