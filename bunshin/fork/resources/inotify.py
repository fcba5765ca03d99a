"""inotify: the child gets a new inotify instance with the same watches, the same watch
descriptors and masks, on the same paths in its own root. The kernel tells which inode a watch
is on (fdinfo: device and inode) but not its path: the path is found by walking the
template's root for that inode (bounded), done once per template. Queued events are not
carried."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

from ...errors import ForkError
from . import sharing

_WATCH = re.compile(r"inotify wd:(\w+) ino:(\w+) sdev:(\w+) mask:(\w+)")
_WALK_LIMIT = 200_000  # entries looked at before giving up on finding a watched inode
_IN_MASK_ADD = 0x20000000


def claims(proc, f) -> bool:
    return f.target == "anon_inode:inotify"


def _watches(hostpid: int, fd: int) -> list[tuple[int, int, int, int]]:
    """(wd, inode, st_dev, mask) of every watch, from fdinfo."""
    with open(f"/proc/{hostpid}/fdinfo/{fd}") as fh:
        out = []
        for m in _WATCH.finditer(fh.read()):
            wd, ino, sdev, mask = (int(x, 16) for x in m.groups())
            out.append((wd, ino, os.makedev(sdev >> 20, sdev & 0xFFFFF), mask))
    return sorted(out)


def _path_of(ctx, proc, ino: int, dev: int) -> str:
    """Path, inside the workspace, of the inode a watch is on (cached per fork batch): the
    watching process's working directory is searched first, then the whole root."""
    cache = ctx.shared.setdefault("inotify-paths", {})
    if (ino, dev) in cache:
        return cache[(ino, dev)]
    tpl_init = next(p.hostpid for p in ctx.plans.values() if p.is_init)
    root = f"/proc/{tpl_init}/root"
    # What the workspace wrote is in the template's upper layer: small, and searched first.
    upper = ctx.shared.get("template-upper")
    if upper:
        for d, dirs, files in os.walk(upper):
            for name in [".", *dirs, *files]:
                rel = (d if name == "." else os.path.join(d, name))[len(upper):] or "/"
                try:
                    st = os.lstat(root + rel)
                except OSError:
                    continue
                if st.st_ino == ino and st.st_dev == dev:
                    cache[(ino, dev)] = rel
                    return rel
    seen = 0
    for top in dict.fromkeys([proc.cwd, "/"]):
        found = _walk(root, top, ino, dev, seen)
        if isinstance(found, str):
            cache[(ino, dev)] = found
            return found
        seen = found
    raise ForkError(f"an inotify watch is on inode {ino}, which is not found in the workspace "
                    f"(within {_WALK_LIMIT} entries): a fork cannot carry it", step="inotify")


def _walk(root: str, top: str, ino: int, dev: int, seen: int) -> str | int:
    """The path of (ino, dev) under ``top``, or how many entries were looked at in all."""
    for d, dirs, files in os.walk(root + top.rstrip("/") if top != "/" else root):
        rel = d[len(root):] or "/"
        if rel.startswith(("/proc", "/sys")):
            dirs[:] = []
            continue
        for name in [".", *dirs, *files]:
            seen += 1
            p = d if name == "." else os.path.join(d, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if st.st_ino == ino and st.st_dev == dev:
                return p[len(root):] or "/"
        if seen > _WALK_LIMIT:
            break
    return seen


def fixup(ctx, proc, r, f) -> None:
    if sharing.reuse(ctx, "inotify", proc, r, f):
        return
    newfd = r.call("inotify_init1", os.O_CLOEXEC | (f.flags & os.O_NONBLOCK))
    next_wd, holes = 1, False
    for wd, ino, dev, mask in _watches(proc.hostpid, f.fd):
        path = _path_of(ctx, proc, ino, dev)
        while next_wd < wd:  # a removed watch left a hole: wds are handed out in order
            holes = True
            hole = r.call("inotify_add_watch", newfd, r.path("/"), 0x1 | _IN_MASK_ADD)
            r.call("inotify_rm_watch", newfd, hole)
            next_wd += 1
        got = r.call("inotify_add_watch", newfd, r.path(path), mask & 0x00FFFFFF)
        if got != wd:
            raise ForkError(f"process {proc.vpid} fd {f.fd}: inotify watch {wd} on {path} came back as {got}")
        next_wd = wd + 1
    if holes:
        _drain(r, newfd)  # removing the hole watches queued IN_IGNORED events
    r.install(newfd, f)
    sharing.remember(ctx, "inotify", proc, f, f.fd)


def _drain(r, fd: int) -> None:
    flags = r.call("fcntl", fd, 3, 0)  # F_GETFL
    r.call("fcntl", fd, 4, flags | os.O_NONBLOCK)
    buf = r.put(bytes(1024))
    while r.call("read", fd, buf, 1024, ok_errnos=(11,)) > 0:  # EAGAIN: empty
        pass
    r.call("fcntl", fd, 4, flags)


OPS = SimpleNamespace(kind="inotify", claims=claims, fixup=fixup)
