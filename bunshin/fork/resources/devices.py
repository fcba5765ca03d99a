"""Character devices every root has (/dev/null, /dev/zero, /dev/urandom, /dev/tty, ...):
reopened by path in the child's own /dev with the same flags."""

from __future__ import annotations

import os
import stat
from types import SimpleNamespace

_SAFE = {"/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty"}


def claims(proc, f) -> bool:
    return stat.S_ISCHR(f.mode) and f.target in _SAFE


def fixup(ctx, proc, r, f) -> None:
    flags = f.flags & ~(os.O_CREAT | os.O_TRUNC | os.O_EXCL) | os.O_NOCTTY
    r.install(r.queue_openat(f.target, flags), f)


OPS = SimpleNamespace(kind="device", claims=claims, fixup=fixup)
