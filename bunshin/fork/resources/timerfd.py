"""timerfd: the child gets a new timerfd on the same clock, re-armed with the time the
template's had left and the same interval, and the expirations not yet read (ticks). All of it
is read from fdinfo when the clone is fixed, so the time left is current."""

from __future__ import annotations

import errno
import os
import re
import struct
import time
from types import SimpleNamespace

from ...errors import ForkError
from . import sharing

_TFD_TIMER_ABSTIME = 1
_TFD_IOC_SET_TICKS = 0x40085400  # _IOW('T', 0, __u64)
_PAIR = re.compile(r"\((\d+),\s*(\d+)\)")


def claims(proc, f) -> bool:
    return f.target == "anon_inode:[timerfd]"


def _ns(text: str) -> int:
    m = _PAIR.match(text)
    assert m is not None, f"timerfd fdinfo time {text!r}"  # the kernel always writes "(sec, nsec)"
    sec, nsec = (int(x) for x in m.groups())
    return sec * 1_000_000_000 + nsec


def _forward(ctx, proc, f) -> None:
    """A periodic timer that fired is not re-armed until it is read: fdinfo would show no time
    left. timerfd_gettime in the template moves it on (counting the expirations in its ticks),
    as the kernel does on any read of it; nothing is consumed."""
    t = ctx.shared["tracees"][proc.hostpid]
    scratch = t.mmap(4096)
    try:
        t.syscall(287, f.fd, scratch)  # timerfd_gettime
    finally:
        t.munmap(scratch, 4096)


def fixup(ctx, proc, r, f) -> None:
    if sharing.reuse(ctx, "timerfd", proc, r, f):
        return
    _forward(ctx, proc, f)
    info = sharing.fdinfo(proc.hostpid, f.fd)
    clock, ticks = int(info["clockid"]), int(info["ticks"])
    setflags = int(info["settime flags"], 8)
    value, interval = _ns(info["it_value"]), _ns(info["it_interval"])  # value: time left
    if interval and not value and ticks:
        # due again since the forward (its expiration is in ticks already): arm it to fire
        # now, before the count is set, or the clone's timer would never run again. With no
        # ticks it is disarmed (settime with no value keeps an interval; gettime shows it).
        value = 1
    newfd = r.call("timerfd_create", clock, os.O_CLOEXEC | (f.flags & os.O_NONBLOCK))
    if value or interval:
        flags = setflags
        if value and setflags & _TFD_TIMER_ABSTIME:
            # same deadline on the same clock (TFD_TIMER_CANCEL_ON_SET needs an absolute time)
            value += time.clock_gettime_ns(clock)
        its = struct.pack("4q", *divmod(interval, 1_000_000_000), *divmod(value, 1_000_000_000))
        r.call("timerfd_settime", newfd, flags, r.put(its), 0)
    if ticks:  # settime resets the count; expirations already due must still be read
        # The ioctl's own answer, not a read-back: a periodic timer may fire again right after.
        rc = r.call("ioctl", newfd, _TFD_IOC_SET_TICKS, r.put(struct.pack("Q", ticks), 64),
                    ok_errnos=(errno.ENOTTY,))
        if rc == -errno.ENOTTY:
            raise ForkError(f"process {proc.vpid} ({proc.name}) fd {f.fd}: timerfd has {ticks} unread "
                            "expirations and this kernel cannot set them (CONFIG_CHECKPOINT_RESTORE)",
                            pid=proc.hostpid, step="timerfd")
    r.install(newfd, f)
    sharing.remember(ctx, "timerfd", proc, f, f.fd)


OPS = SimpleNamespace(kind="timerfd", claims=claims, fixup=fixup)
