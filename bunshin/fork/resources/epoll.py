"""epoll: the child gets a new epoll instance whose interest list (fdinfo's "tfd: N events: X
data: Y" lines) is registered again against the child's own descriptors.

Two halves, because the engine fixes descriptors in number order and an epoll fd may come
before the descriptors it watches: ``OPS.fixup`` puts an empty epoll at the fd's number, and
``PROC.fixup_proc`` (run after every descriptor of the process is recreated) fills it.
Readiness already reported is not kept: an edge-triggered watch fires once more if ready.
"""

from __future__ import annotations

import ctypes
import os
import re
import struct
from types import SimpleNamespace

from ...errors import ForkError
from . import sharing

_LINE = re.compile(r"tfd:\s*(\d+)\s+events:\s*([0-9a-f]+)\s+data:\s*([0-9a-f]+)")
_EPOLL_CTL_ADD = 1
_KCMP_EPOLL_TFD = 7
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def claims(proc, f) -> bool:
    return f.target == "anon_inode:[eventpoll]"


def _watches(proc, f) -> list[tuple[int, int, int]]:
    with open(f"/proc/{proc.hostpid}/fdinfo/{f.fd}") as fh:
        found = [(int(m[1]), int(m[2], 16), int(m[3], 16)) for m in map(_LINE.search, fh) if m]
    for tfd, _, _ in found:
        # The numbers are those the files had when added; make sure each still names its file.
        slot = struct.pack("III", f.fd, tfd, 0)
        same = _libc.syscall(ctypes.c_long(312), ctypes.c_long(proc.hostpid), ctypes.c_long(proc.hostpid),  # kcmp
                             ctypes.c_long(_KCMP_EPOLL_TFD), ctypes.c_long(tfd), slot)
        if same != 0:
            raise ForkError(f"process {proc.vpid} ({proc.name}) fd {f.fd}: epoll watches a file that is "
                            f"no longer open at fd {tfd} in this process; it cannot be re-registered",
                            pid=proc.hostpid, step="epoll")
    return found


def fixup(ctx, proc, r, f) -> None:
    if sharing.reuse(ctx, "epoll", proc, r, f):  # the first clone holding it filled it already
        return
    watches = _watches(proc, f)
    r.install(r.call("epoll_create1", os.O_CLOEXEC), f)
    sharing.remember(ctx, "epoll", proc, f, f.fd)
    ctx.shared.setdefault("epoll-pending", {}).setdefault(proc.hostpid, []).append((f.fd, watches))


def fixup_proc(ctx, proc, r) -> None:
    for epfd, watches in ctx.shared.get("epoll-pending", {}).pop(proc.hostpid, []):
        for tfd, events, data in watches:
            r.call("epoll_ctl", epfd, _EPOLL_CTL_ADD, tfd, r.put(struct.pack("=IQ", events, data)))


OPS = SimpleNamespace(kind="epoll", claims=claims, fixup=fixup)
PROC = SimpleNamespace(kind="epoll-interest", plan_proc=lambda proc: None, fixup_proc=fixup_proc)
