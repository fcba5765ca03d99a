"""SysV message queues live in the workspace's IPC namespace (a fork gets a new, empty one):
every queue is made there again with the same id (msg_next_id), key, owner, creator, mode and
size (qbytes), and its messages sent again in order, each with its type and bytes. They are read
from the template's queue without taking them (msgrcv with MSG_COPY, which needs
CONFIG_CHECKPOINT_RESTORE). The child's queue shows no last sender or receiver (lspid, lrpid:
the trainer sent the messages, from outside its pid namespace) and its own times."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import partial

from .sysv_ipc import (IPC_CREAT, IPC_EXCL, IPC_NOWAIT, IPC_SET, IPC_STAT, IpcPerm, Owner, check_creators, ids,
                       in_ipc_ns, libc, make_as, read_limits, write_limits)

_MSG_COPY = 0o40000
_LIMITS = ("msgmax", "msgmnb", "msgmni")
libc.msgrcv.restype = ctypes.c_ssize_t
libc.msgrcv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long, ctypes.c_int]
libc.msgsnd.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class _MsqidDs(ctypes.Structure):
    """The kernel's struct msqid64_ds (x86_64)."""
    _fields_ = [("perm", IpcPerm), ("stime", ctypes.c_long), ("rtime", ctypes.c_long), ("ctime", ctypes.c_long),
                ("cbytes", ctypes.c_ulong), ("qnum", ctypes.c_ulong), ("qbytes", ctypes.c_ulong),
                ("lspid", ctypes.c_int), ("lrpid", ctypes.c_int), ("unused4", ctypes.c_ulong),
                ("unused5", ctypes.c_ulong)]


@dataclass
class Queue:
    id: int
    key: int
    owner: Owner
    qbytes: int
    messages: list[tuple[int, bytes]]  # (type, text), first to be received first


@dataclass
class Queues:
    """The template's queues and the limits of its IPC namespace."""
    queues: list[Queue]
    limits: dict[str, str]


def _msgctl(qid: int, cmd: int, ds: _MsqidDs) -> None:
    if libc.msgctl(qid, cmd, ctypes.byref(ds)) < 0:
        raise OSError(ctypes.get_errno(), f"msgctl({qid}, {cmd})")


def queues(init_hostpid: int) -> Queues:
    """The template's queues with their messages (read once: a template never runs again)."""
    def read():
        found = []
        for qid in ids("msg"):
            ds = _MsqidDs()
            _msgctl(qid, IPC_STAT, ds)
            room = max(ds.cbytes, 1)  # no message is longer than all of them
            buf = ctypes.create_string_buffer(ctypes.sizeof(ctypes.c_long) + room)
            msgs = []
            for i in range(ds.qnum):
                n = libc.msgrcv(qid, buf, room, i, IPC_NOWAIT | _MSG_COPY)
                if n < 0:
                    raise OSError(ctypes.get_errno(), f"msgrcv({qid}, MSG_COPY {i})")
                msgs.append((ctypes.c_long.from_buffer(buf).value, buf.raw[ctypes.sizeof(ctypes.c_long):][:n]))
            found.append(Queue(qid, ds.perm.key, Owner.of(ds.perm), ds.qbytes, msgs))
        return Queues(found, read_limits(_LIMITS) if found else {})

    out = in_ipc_ns(init_hostpid, read)
    check_creators([q.owner for q in out.queues], "message queues")
    return out


def copy_queues(child_init: int, tpl: Queues) -> None:
    """Make the template's queues in the child's IPC namespace, with their messages."""
    if not tpl.queues:
        return

    def create():
        write_limits(tpl.limits)
        mnb = int(tpl.limits["msgmnb"])
        for q in sorted(tpl.queues, key=lambda q: q.id):
            make_as("msg", q.id, q.owner, partial(libc.msgget, q.key, IPC_CREAT | IPC_EXCL | q.owner.mode))
            ds = _MsqidDs()
            q.owner.set_on(ds.perm)
            # room for every message first: the template's size may have been lowered below
            # what its queue holds. A size above msgmnb takes CAP_SYS_RESOURCE, which the
            # trainer may lack: the namespace's msgmnb is raised meanwhile instead.
            ds.qbytes = max(q.qbytes, sum(len(m) for _, m in q.messages), len(q.messages))
            if ds.qbytes > mnb:
                write_limits({"msgmnb": str(ds.qbytes)})
            _msgctl(q.id, IPC_SET, ds)
            for mtype, text in q.messages:
                buf = ctypes.create_string_buffer(ctypes.c_long(mtype).value.to_bytes(8, "little", signed=True) + text)
                if libc.msgsnd(q.id, buf, len(text), IPC_NOWAIT) < 0:
                    raise OSError(ctypes.get_errno(), f"msgsnd({q.id})")
            if ds.qbytes != q.qbytes:
                ds.qbytes = q.qbytes
                _msgctl(q.id, IPC_SET, ds)
            write_limits({"msgmnb": str(mnb)})

    in_ipc_ns(child_init, create)
