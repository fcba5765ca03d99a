"""Shared memory: MAP_SHARED anonymous memory and memfds become the child's own copy, shared
among the child's processes exactly as among the template's; shared mappings of files are
remapped onto the child's own files (its /dev/shm is a copy of the template's). SysV shared
memory is carried by sysv_shm.py.

fork(2) would keep such memory shared *between* template and child, so a write in one child
would show up in every other: each object is copied once per child into a memfd and mapped at
the same addresses with MAP_FIXED.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import shutil
import stat
from dataclasses import dataclass
from types import SimpleNamespace

from ...errors import ForkError
from ...runtime.userns import owner_inside
from ..plan import maps_of
from ..remote import ANY_ERROR
from . import sharing

_DELETED = " (deleted)"
_ANONYMOUS = "/dev/zero" + _DELETED  # MAP_SHARED anonymous memory, a shmem file
_AT_FDCWD, _NO_FD = -100 & 0xFFFFFFFFFFFFFFFF, 0xFFFFFFFFFFFFFFFF
_MFD_CLOEXEC, _MFD_ALLOW_SEALING = 1, 2
_F_ADD_SEALS, _F_GET_SEALS = 1033, 1034


@dataclass
class SharedMap:
    start: int
    end: int
    prot: int
    offset: int
    path: str
    dev: int
    ino: int
    size: int  # of the backing object
    kept: bool | None = None  # inherited as it is, not remapped (_immutable): set at the first fork
    held_by: tuple[int, int] | None = None  # (vpid, fd) holding a deleted file (check_maps)

    @property
    def anonymous(self) -> bool:
        return self.path == _ANONYMOUS or self.path.startswith("/memfd:")


def _prot(perms: str) -> int:
    return ((mmap.PROT_READ if perms[0] == "r" else 0) | (mmap.PROT_WRITE if perms[1] == "w" else 0)
            | (mmap.PROT_EXEC if perms[2] == "x" else 0))


# a line of /proc/PID/maps whose mapping is shared (permissions "rw-s")
_SHARED = re.compile(r"^\S+ \S{3}s .*$", re.M)


def plan_proc(proc) -> None:
    """Find the shared mappings of ``proc`` (check_maps has, for every process)."""
    if not hasattr(proc, "shared_maps"):
        proc.shared_maps = _shared_maps(proc)


def _shared_maps(proc) -> list[SharedMap]:
    maps = []
    for line in _SHARED.findall(maps_of(proc)):
        parts = line.split(None, 5)
        path = parts[5].strip() if len(parts) > 5 else ""
        if path.startswith("/SYSV"):
            continue  # sysv_shm.py
        start, end = (int(x, 16) for x in parts[0].split("-"))
        st = os.stat(f"/proc/{proc.hostpid}/map_files/{parts[0]}")
        if not stat.S_ISREG(st.st_mode) or not path.startswith("/") or path.startswith("/["):
            # an AIO ring ("/[aio]"), io_uring's rings (anon_inode:[io_uring]), a device's memory
            raise ForkError(f"process {proc.vpid} ({proc.name}) has a shared mapping {parts[0]} of "
                            f"{path or 'an unnamed object'}, neither a file, a memfd nor shared memory: "
                            "a fork cannot make its object again", pid=proc.hostpid, step="plan")
        maps.append(SharedMap(start, end, _prot(parts[1]), int(parts[2], 16), path, st.st_dev,
                              st.st_ino, st.st_size))
    return maps


def check_maps(procs) -> None:
    """Refuse the shared mappings a fork cannot make again, before anything is made; find, for
    a mapping of a deleted file, a descriptor whose clone holds the child's copy of it
    (files_reg): the child's mapping is of that copy, as the template's is of the file a
    descriptor holds. A process is fixed after those before it in the plan: the holder is one
    of them or the mapper itself."""
    holders: dict[tuple[int, int], tuple] = {}  # (dev, ino) -> (vpid, fd), first in plan order
    for p in procs:
        if p.is_init:
            continue
        for f in p.fds:
            if f.target.endswith(_DELETED) and stat.S_ISREG(f.mode) and not claims_fd(p, f):
                holders.setdefault((f.dev, f.ino), (p.vpid, f.fd))
        p.shared_maps = _shared_maps(p)
        for m in p.shared_maps:
            if m.anonymous or not m.path.endswith(_DELETED):
                continue
            m.held_by = holders.get((m.dev, m.ino))
            if m.held_by is None:
                raise ForkError(f"process {p.vpid} ({p.name}) has a shared mapping {m.start:x}-{m.end:x} of "
                                f"deleted file {m.path.removesuffix(_DELETED)}, of which no descriptor of "
                                "this or an earlier process of the workspace is the copy the child would "
                                "map (a fork copies a deleted file a descriptor holds)",
                                pid=p.hostpid, step="plan")


def _name(path: str) -> str:
    """The name memfd_create gives a copy of the object at ``path``: a memfd's own (the kernel
    adds "memfd:" again)."""
    return path.removesuffix(_DELETED).removeprefix("/memfd:").lstrip("/") or "shared"


def _anonymous_object(r, size: int) -> int:
    """A descriptor of new MAP_SHARED anonymous memory (what /proc names "/dev/zero
    (deleted)", as the template's is), taken from its mapping's /proc/self/map_files entry;
    -1 where that is refused."""
    addr = r.call("mmap", 0, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS,
                  _NO_FD, 0)
    fd = r.call("openat", _AT_FDCWD, r.path(f"/proc/self/map_files/{addr:x}-{addr + size:x}"),
                os.O_RDWR | os.O_CLOEXEC, 0, ok_errnos=ANY_ERROR)
    r.call("munmap", addr, size)
    return fd if fd >= 0 else -1


def _object(ctx, proc, r, key, src_path: str, size: int, path: str) -> str:
    """Where, in the child's /proc, its copy of the shared-memory object the template calls
    ``path`` is (made on first use, with the template's mode and owner; its seals come at
    finish, once it is mapped)."""
    objs = ctx.shared.setdefault("shmem", {})
    if key not in objs:
        fd = _anonymous_object(r, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE) if path == _ANONYMOUS and size else -1
        if fd < 0:
            fd = r.call("memfd_create", r.path(_name(path)[:200]), _MFD_CLOEXEC | _MFD_ALLOW_SEALING)
            r.call("ftruncate", fd, size)
        with open(src_path, "rb") as src, open(f"/proc/{r.t.pid}/fd/{fd}", "r+b") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
            st = os.fstat(src.fileno())
            try:
                seals = fcntl.fcntl(src.fileno(), _F_GET_SEALS)
            except OSError:  # not a shmem file (hugetlbfs): it has none
                seals = 0
        r.queue("fchown", fd, *owner_inside(r.t.pid, st))  # first: it drops set-user-ID
        r.queue("fchmod", fd, stat.S_IMODE(st.st_mode))
        objs[key] = (proc.vpid, fd)
        ctx.shared.setdefault("close_later", []).append((r.t, fd))
        if seals and path != _ANONYMOUS:  # anonymous memory is born sealed (F_SEAL_SEAL)
            ctx.shared.setdefault("seals", []).append((r.t, fd, seals))
    vpid, fd = objs[key]
    return f"/proc/{vpid}/fd/{fd}"


def _mount_id(path: str) -> int:
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        return int(sharing.fdinfo(os.getpid(), fd)["mnt_id"])
    finally:
        os.close(fd)


def _immutable(ctx, proc, m: SharedMap) -> bool:
    """A read-only mapping of a file in a lower layer of the workspace's root (glibc's
    gconv-modules.cache in nearly every process) can be inherited as it is: overlayfs copies
    a file up before opening it for writing, so a file still in a lower layer was opened
    read-only and the mapping can never be made writable, and no layer under a child is
    written again. Its bytes are the child's own file's; remapping cost ~0.2 ms a process."""
    upper = ctx.shared.get("template-upper")  # "": the template wrote no file at all
    if upper is None or m.prot & mmap.PROT_WRITE or m.anonymous or m.path.endswith(_DELETED):
        return False
    if upper and os.path.lexists(upper + m.path):  # written since the root was made: maybe opened O_RDWR
        return False
    # on the root's own overlay, not a file system mounted in it (/dev/shm is copied per child)
    return _mount_id(f"/proc/{proc.hostpid}/map_files/{m.start:x}-{m.end:x}") == \
        _mount_id(f"/proc/{proc.hostpid}/root")


def fixup_proc(ctx, proc, r) -> None:
    for m in getattr(proc, "shared_maps", ()):
        if m.kept is None:
            m.kept = _immutable(ctx, proc, m)
        if m.kept:
            continue
        rng = f"{m.start:x}-{m.end:x}"
        if m.anonymous:
            fd = r.queue_openat(_object(ctx, proc, r, (m.dev, m.ino), f"/proc/{proc.hostpid}/map_files/{rng}",
                                        m.size, m.path),
                                os.O_RDWR | os.O_CLOEXEC)
        else:
            flags = (os.O_RDWR if m.prot & mmap.PROT_WRITE else os.O_RDONLY) | os.O_CLOEXEC
            if m.held_by is None:
                fd = r.queue_openat(m.path, flags)
            else:  # a deleted file: the child's copy that clone holds (its descriptor fixed already)
                fd = sharing.queue_open(r, proc, "/proc/{}/fd/{}".format(*m.held_by), flags)
        # queued, so open, map and close take one stop; close runs whatever mmap returned
        got = r.queue("mmap", m.start, m.end - m.start, m.prot, mmap.MAP_SHARED | 0x10,  # MAP_FIXED
                      fd, m.offset, ok_errnos=ANY_ERROR)
        r.queue("close", fd)
        # checked at finish, before the child runs: reading it now would cost a stop of its own
        ctx.shared.setdefault("shmem-mapped", []).append((proc, m, got))


def claims_fd(proc, f) -> bool:
    """memfds, and descriptors of MAP_SHARED anonymous memory (opened from /proc/PID/map_files)."""
    return f.target.startswith("/memfd:") or (f.target == _ANONYMOUS and stat.S_ISREG(f.mode))


def fixup_fd(ctx, proc, r, f) -> None:
    """A memfd descriptor: the child's copy of the same object its mappings use, opened with
    the template's flags."""
    if sharing.take_shared(proc, r, f):
        return
    size = os.stat(f"/proc/{proc.hostpid}/fd/{f.fd}").st_size
    path = _object(ctx, proc, r, (f.dev, f.ino), f"/proc/{proc.hostpid}/fd/{f.fd}", size, f.target)
    fd = r.queue_openat(path, f.flags & ~(os.O_CREAT | os.O_TRUNC | os.O_EXCL))
    if f.pos:
        r.queue("lseek", fd, f.pos, os.SEEK_SET)
    r.install(fd, f)


def finish(ctx) -> None:
    """Seal each copy as the template's object is (now that every clone has mapped it: a seal
    may forbid new writable mappings) and close the memfds kept open for later clones."""
    for proc, m, got in ctx.shared.pop("shmem-mapped", []):
        if got.check() != m.start:
            raise ForkError(f"process {proc.vpid}: shared mapping moved from {m.start:#x} to {got.value:#x}")
    for t, fd, seals in ctx.shared.pop("seals", []):
        got = t.syscall(72, fd, _F_ADD_SEALS, seals)  # fcntl
        if got < 0:
            raise ForkError(f"process {t.pid}: sealing the copy of a memfd: {os.strerror(-got)}",
                            pid=t.pid, step="finish")
    for t, fd in ctx.shared.pop("close_later", []):
        t.syscall(3, fd)


OPS = SimpleNamespace(kind="memfd", claims=claims_fd, fixup=fixup_fd)
MAPPINGS = SimpleNamespace(kind="shared-memory", plan_proc=plan_proc, check_tree=check_maps,
                           fixup_proc=fixup_proc, finish=finish)
