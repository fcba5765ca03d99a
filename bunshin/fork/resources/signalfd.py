"""signalfd: the child gets a new signalfd with the template's signal mask and flags. A
signalfd reads the *reading* thread's pending signals, so nothing else is carried: the clone's
pending signals are raised again by signals.py."""

from __future__ import annotations

import os
import struct
from types import SimpleNamespace

from . import sharing


def claims(proc, f) -> bool:
    return f.target == "anon_inode:[signalfd]"


def fixup(ctx, proc, r, f) -> None:
    if sharing.reuse(ctx, "signalfd", proc, r, f):
        return
    mask = int(sharing.fdinfo(proc.hostpid, f.fd)["sigmask"], 16)
    newfd = r.call("signalfd4", -1 & 0xFFFFFFFFFFFFFFFF, r.put(struct.pack("Q", mask)), 8,
                   os.O_CLOEXEC | (f.flags & os.O_NONBLOCK))
    r.install(newfd, f)
    sharing.remember(ctx, "signalfd", proc, f, f.fd)


OPS = SimpleNamespace(kind="signalfd", claims=claims, fixup=fixup)
