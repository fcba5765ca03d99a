"""epoll: the child gets a new epoll instance whose interest list (fdinfo's "tfd: N events: X
data: Y" lines) is registered again against the child's own copies of the watched files, each
under the same descriptor number, with the same events and data.

An entry is keyed by its file and the number it was added under, and that number need not
name the file any more: the process may have closed it (a dup elsewhere keeps the file, and so
the entry, alive) or reused it for another file. The plan finds, with kcmp, a descriptor of
the workspace that still holds each entry's file (the *holder*); in the child, the holder's
copy is put at the entry's number just for the epoll_ctl, and whatever is there is put back.
The epoll holds no reference of its own, so a file no descriptor of the workspace holds (in
flight in a unix socket, mapped, held outside) cannot be given to the child: refused.

Two halves, because the engine fixes descriptors in number order and an epoll fd may come
before the descriptors it watches: ``OPS.fixup`` puts an empty epoll at the fd's number, and
``PROC.fixup_proc`` (run after every descriptor of the process is recreated) fills it; an
entry whose holder is a process cloned later is added by that process's clone.
Readiness already reported is not kept: an edge-triggered watch fires once more if ready.
"""

from __future__ import annotations

import ctypes
import os
import re
import struct
from dataclasses import dataclass
from types import SimpleNamespace

from ...errors import ForkError
from . import sharing

_LINE = re.compile(r"tfd:\s*(\d+)\s+events:\s*([0-9a-f]+)\s+data:\s*([0-9a-f]+)\s+pos:\s*-?\d+\s+"
                   r"ino:\s*([0-9a-f]+)\s+sdev:\s*([0-9a-f]+)")
_EPOLL_CTL_ADD = 1
_KCMP_EPOLL_TFD = 7
_F_GETFD, _F_DUPFD_CLOEXEC = 1, 1030
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


@dataclass
class Entry:
    """One entry of an epoll's interest list, and the template descriptor holding its file."""

    tfd: int
    events: int
    data: int
    holder: object  # the ProcPlan holding the file
    fd: int  # its descriptor there


def claims(proc, f) -> bool:
    return f.target == "anon_inode:[eventpoll]"


def _holds(epoll_proc, epfd: int, tfd: int, nth: int, proc, fd: int) -> bool:
    """Whether descriptor ``fd`` of ``proc`` is the file of the ``nth`` entry added under
    number ``tfd`` to epoll ``epfd`` of ``epoll_proc`` (kcmp's KCMP_EPOLL_TFD)."""
    slot = struct.pack("III", epfd, tfd, nth)
    return _libc.syscall(ctypes.c_long(312), ctypes.c_long(proc.hostpid), ctypes.c_long(epoll_proc.hostpid),
                         ctypes.c_long(_KCMP_EPOLL_TFD), ctypes.c_long(fd), slot) == 0  # kcmp


def _entries(procs, proc, f) -> list[Entry]:
    with open(f"/proc/{proc.hostpid}/fdinfo/{f.fd}") as fh:
        text = fh.read().splitlines()
    lines = [m for m in map(_LINE.search, text) if m]
    listed = sum(line.startswith("tfd:") for line in text)
    if len(lines) != listed:  # a format this fork cannot read: never an entry left out
        raise ForkError(f"process {proc.vpid} ({proc.name}) fd {f.fd}: epoll lists {listed} entries in fdinfo, "
                        f"{len(lines)} of them in a form this fork reads, so the child would miss some",
                        pid=proc.hostpid, step="plan")
    seen: dict[int, int] = {}
    out = []
    for m in lines:
        tfd, events, data, ino, sdev = int(m[1]), int(m[2], 16), int(m[3], 16), int(m[4], 16), int(m[5], 16)
        nth = seen[tfd] = seen.get(tfd, -1) + 1  # kcmp counts entries of one number in fdinfo's order
        dev = os.makedev(sdev >> 20, sdev & 0xFFFFF)
        # The number's own file first (the usual case), then any descriptor of the same inode,
        # this process first; the workspace's init holds none of the workspace's files.
        candidates = [(proc, g.fd) for g in proc.fds if g.fd == tfd]
        for p in [proc, *(q for q in procs if q is not proc and not q.is_init)]:
            candidates += [(p, g.fd) for g in p.fds if g.ino == ino and g.dev == dev]
        holder = next((c for c in candidates if _holds(proc, f.fd, tfd, nth, *c)), None)
        if holder is None:
            raise ForkError(f"process {proc.vpid} ({proc.name}) fd {f.fd}: epoll watches, under fd number {tfd}, "
                            f"a file that no descriptor of the workspace holds any more (it is kept by something "
                            f"else: in flight in a unix socket, mapped, or held outside the workspace), so the "
                            f"child cannot be given that file", pid=proc.hostpid, step="plan")
        out.append(Entry(tfd, events, data, *holder))
    return out


def check_tree(procs) -> None:
    """Find, at plan time, the holder of every entry's file, refusing an entry without one."""
    for p in procs:
        for f in p.fds:
            if f.handler is OPS and f.dup_of is None:
                f.epoll_entries = _entries(procs, p, f)


def fixup(ctx, proc, r, f) -> None:
    if sharing.reuse(ctx, "epoll", proc, r, f):  # the first clone holding it filled it already
        return
    r.install(r.call("epoll_create1", os.O_CLOEXEC), f)
    sharing.remember(ctx, "epoll", proc, f, f.fd)
    done = ctx.shared.setdefault("epoll-done", set())
    pending = ctx.shared.setdefault("epoll-pending", {})
    for e in f.epoll_entries:
        if e.holder.hostpid in done:  # cloned before: its copy of the file is taken from it
            pending.setdefault(proc.hostpid, []).append(((proc.vpid, f.fd), e, (e.holder.vpid, e.fd)))
        else:  # this process, or one cloned later, adds it
            pending.setdefault(e.holder.hostpid, []).append(((proc.vpid, f.fd), e, None))


def fixup_proc(ctx, proc, r) -> None:
    """Add the entries left to this process: those whose file it holds, to an epoll made here
    or earlier, and those of its own epolls whose file an earlier clone holds."""
    ctx.shared.setdefault("epoll-done", set()).add(proc.hostpid)
    for where, e, source in ctx.shared.get("epoll-pending", {}).pop(proc.hostpid, []):
        floor = max([g.fd for g in proc.fds] + [e.tfd]) + 1  # above every number in play
        taken = []  # copies taken out of earlier clones, for this call only
        epfd, fd = where[1], e.fd
        if where[0] != proc.vpid:
            epfd = _above(r, sharing.grab(r, where), floor)
            taken.append(epfd)
        if source is not None:
            fd = _above(r, sharing.grab(r, source), floor)
            taken.append(fd)
        _add(r, proc, epfd, e.tfd, fd, e.events, e.data, floor)
        for copy in taken:
            r.queue("close", copy)


def _above(r, fd: int, floor: int) -> int:
    """``fd`` moved to a number no fixup here uses."""
    high = r.call("fcntl", fd, _F_DUPFD_CLOEXEC, floor)
    r.queue("close", fd)
    return high


def _add(r, proc, epfd: int, tfd: int, fd: int, events: int, data: int, floor: int) -> None:
    """Add the file at ``fd`` to epoll ``epfd`` under number ``tfd``."""
    event = r.queue_put(struct.pack("=IQ", events, data))
    if fd == tfd:
        r.queue("epoll_ctl", epfd, _EPOLL_CTL_ADD, tfd, event)
        return
    # The file at the entry's number for the call; what is there goes aside and back.
    there = next((g for g in proc.fds if g.fd == tfd), None)
    if there is not None:
        cloexec = there.cloexec if there.cloexec is not None else bool(r.call("fcntl", tfd, _F_GETFD, 0) & 1)
        aside = r.queue("fcntl", tfd, _F_DUPFD_CLOEXEC, floor)
    r.queue("dup3", fd, tfd, os.O_CLOEXEC)
    r.queue("epoll_ctl", epfd, _EPOLL_CTL_ADD, tfd, event)
    if there is None:
        r.queue("close", tfd)
    else:
        r.queue("dup3", aside, tfd, os.O_CLOEXEC if cloexec else 0)
        r.queue("close", aside)


def finish(ctx) -> None:
    left = ctx.shared.pop("epoll-pending", {})
    if left:
        raise ForkError(f"epoll entries whose files processes {sorted(left)} hold were never added: "
                        "those processes were not cloned", step="epoll")


OPS = SimpleNamespace(kind="epoll", claims=claims, fixup=fixup, check_tree=check_tree)
PROC = SimpleNamespace(kind="epoll-interest", plan_proc=lambda proc: None, fixup_proc=fixup_proc, finish=finish)
