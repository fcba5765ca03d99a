"""What the fork engine cannot carry yet: refused at plan time, before anything is touched, with
the process, descriptor and kind named (sockets, epoll, eventfd, timerfd, signalfd, inotify,
pty masters and block devices arrive with the communication issue)."""

from __future__ import annotations

from types import SimpleNamespace

from ...errors import ForkError
from ..plan import kind_of


def _refuse(proc, f) -> bool:
    raise ForkError(
        f"process {proc.vpid} ({proc.name}) fd {f.fd} is a {kind_of(f)} ({f.target}): "
        "a fork cannot carry it yet; close it before forking",
        pid=proc.hostpid, step="plan")


OPS = SimpleNamespace(kind="unsupported", claims=_refuse, fixup=None)
