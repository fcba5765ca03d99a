"""What SysV shared memory, semaphores and message queues share: reading and making them in a
workspace's IPC namespace from the trainer, and making an object with a chosen id and creator.
A fork's child gets a new, empty IPC namespace; each kind's module recreates its objects there
before the child's processes run."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from collections.abc import Callable
from typing import TypeVar

from ...errors import ForkError

libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWIPC = 0x08000000
IPC_CREAT, IPC_EXCL, IPC_NOWAIT = 0o1000, 0o2000, 0o4000
IPC_SET, IPC_STAT = 1, 2
_SYS_SETRESUID, _SYS_SETRESGID = 117, 119
T = TypeVar("T")


class IpcPerm(ctypes.Structure):
    """The kernel's struct ipc64_perm (x86_64), the head of every object's *id_ds."""
    _fields_ = [("key", ctypes.c_int), ("uid", ctypes.c_uint), ("gid", ctypes.c_uint), ("cuid", ctypes.c_uint),
                ("cgid", ctypes.c_uint), ("mode", ctypes.c_uint), ("seq", ctypes.c_ushort),
                ("pad", ctypes.c_ushort), ("unused1", ctypes.c_ulong), ("unused2", ctypes.c_ulong)]


@dataclass
class Owner:
    """Who an object belongs to: its owner (uid, gid), who made it (cuid, cgid), its mode."""
    uid: int
    gid: int
    cuid: int
    cgid: int
    mode: int

    @classmethod
    def of(cls, p: IpcPerm) -> Owner:
        return cls(p.uid, p.gid, p.cuid, p.cgid, p.mode & 0o777)

    def set_on(self, p: IpcPerm) -> None:
        p.uid, p.gid, p.mode = self.uid, self.gid, self.mode


def in_ipc_ns(init_hostpid: int, fn: Callable[[], T]) -> T:
    """Run ``fn`` in the IPC namespace of ``init_hostpid``: the calling thread joins it and
    comes back (setns of an IPC namespace affects only the calling thread, and unlike a mount
    namespace's it is allowed in a threaded process). A thread made for it cost ~0.3 ms."""
    home = os.open("/proc/thread-self/ns/ipc", os.O_RDONLY | os.O_CLOEXEC)
    try:
        fd = os.open(f"/proc/{init_hostpid}/ns/ipc", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.setns(fd, _CLONE_NEWIPC):
                raise OSError(ctypes.get_errno(), "setns(ipc)")
        finally:
            os.close(fd)
        try:
            return fn()
        finally:
            if libc.setns(home, _CLONE_NEWIPC):
                raise OSError(ctypes.get_errno(), "setns back to the trainer's own IPC namespace")
    finally:
        os.close(home)


def ids(table: str) -> list[int]:
    """The ids of the objects of one kind ("shm", "sem", "msg") in the calling thread's IPC
    namespace."""
    with open(f"/proc/sysvipc/{table}") as f:
        return [int(line.split()[1]) for line in f.readlines()[1:] if line.strip()]


def check_creators(owners: list[Owner], what: str) -> None:
    """Plan time: an object made by another user is made again as that user, which takes
    root (see :func:`make_as`)."""
    if os.geteuid() != 0 and any((o.cuid, o.cgid) != (os.geteuid(), os.getegid()) for o in owners):
        raise ForkError(f"the workspace holds SysV {what} made by another user: only a trainer running as "
                        "root can make them again with their creator", step="plan")


def make_as(kind: str, want_id: int, creator: Owner, make: Callable[[], int]) -> None:
    """Call ``make`` (an xxxget with IPC_CREAT | IPC_EXCL) so that it makes object ``want_id``
    as ``creator``: the namespace's next id is set (``kind``_next_id, as CRIU does) and the
    calling thread takes the creator's uid and gid for the call, since cuid and cgid are set
    only by the kernel, from the maker. The ids are set by raw system calls, which change only
    the calling thread (glibc's setresuid would change every thread of the trainer)."""
    with open(f"/proc/sys/kernel/{kind}_next_id", "w") as f:
        f.write(str(want_id))
    me_uid, me_gid = os.geteuid(), os.getegid()
    switch = (creator.cuid, creator.cgid) != (me_uid, me_gid)
    if switch:  # the group first: a thread no longer root could not change it
        if libc.syscall(_SYS_SETRESGID, -1, creator.cgid, -1) or libc.syscall(_SYS_SETRESUID, -1, creator.cuid, -1):
            err = ctypes.get_errno()
            _back(me_uid, me_gid)
            raise OSError(err, f"taking uid {creator.cuid} gid {creator.cgid} to make a SysV {kind}")
    try:
        got = make()
        err = ctypes.get_errno()
    finally:
        if switch:
            _back(me_uid, me_gid)
    if got != want_id:
        raise ForkError(f"SysV {kind} {want_id} came back as {got} in the child (errno {err})", step="sysv")


def _back(uid: int, gid: int) -> None:
    if libc.syscall(_SYS_SETRESUID, -1, uid, -1) or libc.syscall(_SYS_SETRESGID, -1, gid, -1):
        raise OSError(ctypes.get_errno(), "taking back the fork thread's own uid and gid")


def read_limits(names: tuple[str, ...]) -> dict[str, str]:
    """The calling thread's IPC namespace's limits ``names`` (/proc/sys/kernel/...)."""
    out = {}
    for n in names:
        with open(f"/proc/sys/kernel/{n}") as f:
            out[n] = f.read()
    return out


def write_limits(limits: dict[str, str]) -> None:
    """Give the calling thread's IPC namespace the template's ``limits`` where they differ:
    the template's objects were made under them (a message longer than a new namespace's
    msgmax could not be sent again)."""
    for n, v in limits.items():
        path = f"/proc/sys/kernel/{n}"
        with open(path) as f:
            if f.read().split() == v.split():
                continue
        # Only its namespace's root may write them (not even host root, in the namespace of a
        # sandbox's user namespace): the thread takes that root's ids for the write.
        st = os.stat(path)
        me_uid, me_gid = os.geteuid(), os.getegid()
        switch = (st.st_uid, st.st_gid) != (me_uid, me_gid)
        if switch and (libc.syscall(_SYS_SETRESGID, -1, st.st_gid, -1)
                       or libc.syscall(_SYS_SETRESUID, -1, st.st_uid, -1)):
            err = ctypes.get_errno()
            _back(me_uid, me_gid)
            raise OSError(err, f"taking uid {st.st_uid} to set the IPC namespace's {n}")
        try:
            with open(path, "w") as f:
                f.write(v)
        finally:
            if switch:
                _back(me_uid, me_gid)
