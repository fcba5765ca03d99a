"""SysV shared memory lives in the workspace's IPC namespace (a fork gets a new, empty one):
every segment is recreated there with the same id (shm_next_id), key, size and mode, its
bytes copied, and each clone's attachment is remapped onto the child's segment at the same
address (SHM_REMAP). Semaphores and message queues: sysv_sem.py, sysv_msg.py."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from types import SimpleNamespace

from ...errors import ForkError
from ..plan import maps_of
from .sysv_ipc import IPC_CREAT, IPC_EXCL, in_ipc_ns, libc

_libc = libc
_libc.shmat.restype = ctypes.c_void_p
_libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
_libc.shmdt.argtypes = [ctypes.c_void_p]
_SHM_RDONLY, _SHM_REMAP = 0o10000, 0o40000


@dataclass
class Segment:
    key: int
    id: int
    mode: int
    size: int


def segments(init_hostpid: int) -> list[Segment]:
    """The template's segments."""
    def read():
        with open("/proc/sysvipc/shm") as f:
            rows = [line.split() for line in f.readlines()[1:] if line.strip()]
        return [Segment(int(r[0]), int(r[1]), int(r[2], 8), int(r[3])) for r in rows]

    return in_ipc_ns(init_hostpid, read)


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
            with open("/proc/sys/kernel/shm_next_id", "w") as f:
                f.write(str(s.id))
            got = _libc.shmget(s.key, ctypes.c_size_t(s.size), IPC_CREAT | IPC_EXCL | (s.mode & 0o777))
            if got != s.id:
                raise ForkError(f"SysV segment {s.id} came back as {got} in the child "
                                f"(errno {ctypes.get_errno()})", step="sysv")
            addr = _libc.shmat(got, None, 0)
            ctypes.memmove(addr, data[s.id], s.size)
            _libc.shmdt(addr)

    in_ipc_ns(template_init, read)
    in_ipc_ns(child_init, create)


def plan_proc(proc) -> None:
    maps = []
    text = maps_of(proc)
    # most processes attach no segment: their maps are not split line by line
    for line in text.splitlines() if "/SYSV" in text else ():
        parts = line.split()
        if len(parts) >= 6 and parts[5].startswith("/SYSV"):
            start, _ = (int(x, 16) for x in parts[0].split("-"))
            shmid = int(parts[4])  # the inode of a SysV mapping is its shmid
            maps.append((start, shmid, "w" not in parts[1]))
    proc.sysv_maps = maps


def fixup_proc(ctx, proc, r) -> None:
    for start, shmid, rdonly in getattr(proc, "sysv_maps", ()):
        got = r.call("shmat", shmid, start, _SHM_REMAP | (_SHM_RDONLY if rdonly else 0))
        if got != start:
            raise ForkError(f"process {proc.vpid}: SysV segment {shmid} moved from {start:#x} to {got:#x}")


OPS = SimpleNamespace(kind="sysv-shm", plan_proc=plan_proc, fixup_proc=fixup_proc)
