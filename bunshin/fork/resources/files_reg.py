"""Regular files and directories of the workspace: reopened by path in the child's root (its
own overlay) with the same flags and offset. A deleted-but-open file gets a private copy."""

from __future__ import annotations

import os
import shutil
import stat
from types import SimpleNamespace

from ...errors import ForkError

_DELETED = " (deleted)"
_O_TMPFILE = 0o20000000 | os.O_DIRECTORY


def claims(proc, f) -> bool:
    return (stat.S_ISREG(f.mode) or stat.S_ISDIR(f.mode)) and f.target.startswith("/")


def fixup(ctx, proc, r, f) -> None:
    flags = f.flags & ~(os.O_CREAT | os.O_TRUNC | os.O_EXCL) | os.O_NOCTTY
    if f.target.endswith(_DELETED):
        newfd = _copy_deleted(ctx, proc, r, f)
    else:
        newfd = r.queue_openat(f.target, flags)
    if f.pos and not stat.S_ISDIR(f.mode):
        r.queue("lseek", newfd, f.pos, os.SEEK_SET)
    elif f.pos:
        # a directory's position is an opaque cookie; replay it as getdents would
        r.queue("lseek", newfd, f.pos, os.SEEK_SET)
    r.install(newfd, f)


def _copy_deleted(ctx, proc, r, f) -> int:
    """An unlinked file lives only in the template; the child gets its own unlinked copy."""
    if not stat.S_ISREG(f.mode):
        raise ForkError(f"process {proc.vpid} fd {f.fd}: deleted directory {f.target} cannot be forked")
    parent = os.path.dirname(f.target[: -len(_DELETED)]) or "/"
    newfd = -1
    for d in (parent, "/tmp", "/dev/shm"):
        newfd = r.call("openat", -100 & 0xFFFFFFFFFFFFFFFF, r.path(d), _O_TMPFILE | os.O_RDWR, 0o600,
                       ok_errnos=tuple(range(1, 200)))
        if newfd >= 0:
            break
    if newfd < 0:
        raise ForkError(f"process {proc.vpid} fd {f.fd}: no place for a copy of deleted file {f.target}")
    with open(f"/proc/{proc.hostpid}/fd/{f.fd}", "rb") as src, \
            open(f"/proc/{r.t.pid}/fd/{newfd}", "r+b") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    mode = f.flags & (os.O_APPEND | os.O_NONBLOCK)
    if mode:
        r.queue("fcntl", newfd, 4, mode)  # F_SETFL
    return newfd


OPS = SimpleNamespace(kind="file", claims=claims, fixup=fixup)
