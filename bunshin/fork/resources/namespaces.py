"""Descriptors of namespaces (/proc/PID/ns/*): one of the workspace's own namespaces becomes
the child's own of that kind, opened in the clone from its init's /proc/1/ns. Any other (one
made inside the workspace by unshare, one passed in from outside) is refused at plan time: a
fork cannot make it again."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

from ...errors import ForkError

_TARGET = re.compile(r"(cgroup|ipc|mnt|net|pid|time|user|uts):\[(\d+)\]$")


def claims(proc, f) -> bool:
    return _TARGET.match(f.target) is not None


def _kind(target: str) -> str:
    m = _TARGET.match(target)
    assert m is not None, target  # claims() took only descriptors whose target matches
    return m[1]


def check_tree(procs) -> None:
    init = procs[0].hostpid
    for p in procs:
        for f in p.fds:
            if f.handler is not OPS or f.dup_of is not None:
                continue
            kind = _kind(f.target)
            if os.readlink(f"/proc/{init}/ns/{kind}") != f.target:
                raise ForkError(f"process {p.vpid} ({p.name}) fd {f.fd} is a {kind} namespace "
                                f"({f.target}) that is not the workspace's own: a fork cannot make it again",
                                pid=p.hostpid, step="plan")


def fixup(ctx, proc, r, f) -> None:
    kind = _kind(f.target)
    r.install(r.queue_openat(f"/proc/1/ns/{kind}", f.flags & (os.O_ACCMODE | os.O_PATH) | os.O_CLOEXEC), f)


OPS = SimpleNamespace(kind="namespace", claims=claims, fixup=fixup, check_tree=check_tree)
