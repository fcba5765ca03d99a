"""SysV shared memory lives in the workspace's IPC namespace (a fork gets a new, empty one):
every segment is recreated there with the same id (shm_next_id), key, size, creator, owner and
mode, its bytes copied, locked in memory if it was (SHM_LOCK), and each clone's attachment is
remapped onto the child's segment at the same address (SHM_REMAP), its pieces given their
protections again (an mprotect splits one). A segment removed while attached (SHM_DEST) is
removed in the child once every clone has attached it. An attachment of which a piece was
unmapped is refused: shmat maps a segment whole. Semaphores and message queues: sysv_sem.py,
sysv_msg.py."""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

from ...errors import ForkError
from ..plan import maps_of
from .sysv_ipc import IPC_CREAT, IPC_EXCL, IPC_SET, IpcPerm, Owner, check_creators, in_ipc_ns, libc, make_as

_libc = libc
_libc.shmat.restype = ctypes.c_void_p
_libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
_libc.shmdt.argtypes = [ctypes.c_void_p]
_SHM_RDONLY, _SHM_REMAP, _SHM_EXEC = 0o10000, 0o40000, 0o100000
_SHM_DEST, _SHM_LOCKED = 0o1000, 0o2000  # in a segment's mode: removed (gone at its last detach); locked
_IPC_RMID, _SHM_LOCK = 0, 11
_SYS_MPROTECT = 10


class _ShmidDs(ctypes.Structure):
    """struct shmid64_ds (x86_64): IPC_SET reads its owner and mode."""
    _fields_ = [("perm", IpcPerm), ("segsz", ctypes.c_size_t), ("times", ctypes.c_long * 3),
                ("cpid", ctypes.c_int), ("lpid", ctypes.c_int), ("nattch", ctypes.c_ulong),
                ("unused", ctypes.c_ulong * 2)]


@dataclass
class Segment:
    key: int
    id: int
    mode: int  # with SHM_DEST
    size: int
    owner: Owner

    @property
    def removed(self) -> bool:
        return bool(self.mode & _SHM_DEST)


def segments(init_hostpid: int) -> list[Segment]:
    """The template's segments."""
    def read():
        with open("/proc/sysvipc/shm") as f:
            rows = [line.split() for line in f.readlines()[1:] if line.strip()]
        # key shmid perms size cpid lpid nattch uid gid cuid cgid ...
        return [Segment(int(r[0]), int(r[1]), int(r[2], 8), int(r[3]),
                        Owner(int(r[7]), int(r[8]), int(r[9]), int(r[10]), int(r[2], 8) & 0o777)) for r in rows]

    segs = in_ipc_ns(init_hostpid, read)
    check_creators([s.owner for s in segs], "shared memory")
    return segs


def copy_segments(template_init: int, child_init: int, segs: list[Segment]) -> None:
    """Recreate ``segs`` in the child's IPC namespace with the same ids and contents."""
    if not segs:
        return
    data = {}

    def read():
        for s in segs:
            addr = _libc.shmat(s.id, None, _SHM_RDONLY)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"shmat({s.id})")
            try:
                data[s.id] = ctypes.string_at(addr, s.size)
            finally:
                _libc.shmdt(addr)

    def create():
        for s in sorted(segs, key=lambda s: s.id):
            make_as("shm", s.id, s.owner, partial(_libc.shmget, s.key, ctypes.c_size_t(s.size),
                                                  IPC_CREAT | IPC_EXCL | s.owner.mode))
            ds = _ShmidDs()
            s.owner.set_on(ds.perm)
            if _libc.shmctl(s.id, IPC_SET, ctypes.byref(ds)):
                raise OSError(ctypes.get_errno(), f"shmctl({s.id}, IPC_SET)")
            if s.mode & _SHM_LOCKED and _libc.shmctl(s.id, _SHM_LOCK, None):
                raise OSError(ctypes.get_errno(), f"shmctl({s.id}, SHM_LOCK)")
            addr = _libc.shmat(s.id, None, 0)
            ctypes.memmove(addr, data[s.id], s.size)
            _libc.shmdt(addr)

    in_ipc_ns(template_init, read)
    in_ipc_ns(child_init, create)


@dataclass
class Attachment:
    """One shmat of a segment, in the pieces an mprotect made of it (start, end, prot)."""
    shmid: int
    start: int
    pieces: list[tuple[int, int, int]]

    @property
    def prot(self) -> int:
        """What shmat gives it whole: writable where a piece is, executable likewise."""
        prot = mmap.PROT_READ
        for _start, _end, p in self.pieces:
            prot |= p & (mmap.PROT_WRITE | mmap.PROT_EXEC)
        return prot


def _prot(perms: str) -> int:
    return ((mmap.PROT_READ if perms[0] == "r" else 0) | (mmap.PROT_WRITE if perms[1] == "w" else 0)
            | (mmap.PROT_EXEC if perms[2] == "x" else 0))


def plan_proc(proc) -> None:
    """``proc``'s attachments, each told by its segment and the address its offset 0 is at;
    one with a piece unmapped is refused (a shmat maps the whole segment)."""
    found: dict[tuple[int, int], Attachment] = {}
    text = maps_of(proc)
    # most processes attach no segment: their maps are not split line by line
    for line in text.splitlines() if "/SYSV" in text else ():
        parts = line.split()
        if len(parts) >= 6 and parts[5].startswith("/SYSV"):
            start, end = (int(x, 16) for x in parts[0].split("-"))
            shmid = int(parts[4])  # the inode of a SysV mapping is its shmid
            base = start - int(parts[2], 16)
            found.setdefault((shmid, base), Attachment(shmid, base, [])).pieces.append(
                (start, end, _prot(parts[1])))
    for a in found.values():
        size = os.stat(f"/proc/{proc.hostpid}/map_files/{a.pieces[0][0]:x}-{a.pieces[0][1]:x}").st_size
        covered = a.start
        for start, end, _ in sorted(a.pieces):
            covered = end if start == covered else -1
        if covered < a.start + size:  # a gap (-1), or its end unmapped
            raise ForkError(f"process {proc.vpid} ({proc.name}) has SysV segment {a.shmid} attached at "
                            f"{a.start:#x} only in part (a piece unmapped with munmap): shmat maps a segment "
                            "whole, so its clone could not have it so", pid=proc.hostpid, step="plan")
    proc.sysv_maps = list(found.values())


def fixup_proc(ctx, proc, r) -> None:
    for a in getattr(proc, "sysv_maps", ()):
        flags = (_SHM_REMAP | (0 if a.prot & mmap.PROT_WRITE else _SHM_RDONLY)
                 | (_SHM_EXEC if a.prot & mmap.PROT_EXEC else 0))
        got = r.call("shmat", a.shmid, a.start, flags)
        if got != a.start:
            raise ForkError(f"process {proc.vpid}: SysV segment {a.shmid} moved from {a.start:#x} to {got:#x}")
        for start, end, prot in a.pieces:
            if prot != a.prot:  # after shmat's call, so made at once by the stopped clone
                err = r.t.syscall(_SYS_MPROTECT, start, end - start, prot)
                if err < 0:
                    raise ForkError(f"process {proc.vpid}: mprotect of SysV segment {a.shmid}'s piece "
                                    f"{start:#x}: {os.strerror(-err)}", pid=proc.hostpid, step="fixup")


def finish(ctx) -> None:
    """Remove, in the child, the segments the template had removed while attached (SHM_DEST),
    now that every clone has attached its own: each then goes with its last detach."""
    if not any(getattr(p, "sysv_maps", None) for p in ctx.plans.values()):
        return  # a removed segment is attached, or gone
    removed = [s.id for s in segments(ctx.plans[1].hostpid) if s.removed]

    def remove():
        for shmid in removed:
            if _libc.shmctl(shmid, _IPC_RMID, None):
                raise OSError(ctypes.get_errno(), f"shmctl({shmid}, IPC_RMID)")

    if removed:
        in_ipc_ns(ctx.init_hostpid, remove)


OPS = SimpleNamespace(kind="sysv-shm", plan_proc=plan_proc, fixup_proc=fixup_proc, finish=finish)
