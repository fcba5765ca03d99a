"""inotify: the child gets a new inotify instance with the same watches, the same watch
descriptors and masks, on the same paths in its own root. The kernel tells which inode a watch
is on (fdinfo: device and inode) but not its path: the path is found by walking the
template's root for that inode (bounded), done once per template.

A watch on a deleted file or directory lives while something holds the inode: the plan looks
for a descriptor (or working directory) of the workspace holding it, and the watch is added in
the child through /proc to that holder's copy (files_reg.py makes one), once the holder's
clone has it: by the holder's clone, when that comes later.

Queued events are not carried: inotify has neither a peek nor a way to put an event in a
queue, and reading the template's queue would empty it for every later fork. The plan logs,
by process and fd, each instance that has events queued; the child's starts empty (the events
the fork's own file operations cause are read away once the child is whole)."""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import stat
import re
import struct
import termios
from types import SimpleNamespace

from ...errors import ForkError
from ...fdwait import readable
from ..plan import maps_of
from . import sharing

log = logging.getLogger(__name__)
_WATCH = re.compile(r"inotify wd:(\w+) ino:(\w+) sdev:(\w+) mask:(\w+)(?:[^\n]*fhandle-type:(\w+) f_handle:(\w+))?")
_WALK_LIMIT = 200_000  # entries looked at before giving up on finding a watched inode
_MAX_HOLES = 4096  # wds are handed out in order: each hole below the last costs two calls
_MFD_CLOEXEC = 1
_AT_FDCWD, _AT_HANDLE_FID, _AT_SYMLINK_FOLLOW, _MAX_HANDLE = -100, 0x200, 0x400, 128
_libc = ctypes.CDLL(None, use_errno=True)
# fdinfo's mask: the events, and the flags a watch keeps (IN_EXCL_UNLINK, IN_ONESHOT)
_KEPT = 0x00FFFFFF | 0x04000000 | 0x80000000
_IN_DONT_FOLLOW = 0x02000000


def claims(proc, f) -> bool:
    return f.target == "anon_inode:inotify"


def _watches_handles(hostpid: int, fd: int) -> list[tuple[int, int, int, int, str]]:
    """(wd, inode, st_dev, mask, file handle) of every watch, from fdinfo."""
    return _watches_listed(hostpid, fd)[0]


def _watches_listed(hostpid: int, fd: int) -> tuple[list[tuple[int, int, int, int, str]], int]:
    """_watches_handles, and how many watches fdinfo lists (in a form it reads or not)."""
    with open(f"/proc/{hostpid}/fdinfo/{fd}") as fh:
        text = fh.read()
        out = []
        for m in _WATCH.finditer(text):
            wd, ino, sdev, mask = (int(x, 16) for x in m.groups()[:4])
            handle = f"{m[5]}:{m[6]}" if m[5] else "none"  # a file system without handles
            out.append((wd, ino, os.makedev(sdev >> 20, sdev & 0xFFFFF), mask, handle))
    return sorted(out), sum(line.startswith("inotify wd:") for line in text.splitlines())


def _handle(path: str, follow: bool) -> str:
    """The file handle of ``path`` as fdinfo prints a watch's, "" if it has none."""
    buf = ctypes.create_string_buffer(struct.pack("Ii", _MAX_HANDLE, 0), 8 + _MAX_HANDLE)
    mount_id = ctypes.c_int()
    if _libc.name_to_handle_at(_AT_FDCWD, os.fsencode(path), buf, ctypes.byref(mount_id),
                               _AT_HANDLE_FID | (_AT_SYMLINK_FOLLOW if follow else 0)) != 0:
        return ""
    size, kind = struct.unpack_from("Ii", buf.raw)
    return f"{kind:x}:{buf.raw[8:8 + size].hex()}"


def _is(st: os.stat_result, path: str, ino: int, dev: int, handle: str, follow: bool = False) -> bool:
    """Whether ``path`` (``st``) is the watched inode: overlayfs gives a non-directory's stat
    the device of the layer it comes from, not the one a watch shows, and inode numbers of
    two layers may be equal (without xino), so its handle decides where the kernel gives one."""
    if st.st_ino != ino:
        return False
    mine = _handle(path, follow) if handle else ""
    if mine:
        return mine == handle
    # no handle to compare (AT_HANDLE_FID is 6.5's): a directory shows the overlay's device as
    # a watch does, a file its layer's, so only the inode number can tell
    return st.st_dev == dev or not stat.S_ISDIR(st.st_mode)


def _path_of(root: str, upper: str | None, proc, ino: int, dev: int, handle: str, cache: dict) -> str | None:
    """Path, inside the workspace whose root is ``root``, of the inode a watch is on; the
    workspace's upper layer is searched first, then the watching process's working directory,
    then the whole root. None when not found."""
    if (ino, dev) in cache:
        return cache[(ino, dev)]
    # What the workspace wrote is in its upper layer: small, and searched first.
    if upper:
        for d, dirs, files in os.walk(upper):
            for name in [".", *dirs, *files]:
                rel = (d if name == "." else os.path.join(d, name))[len(upper):] or "/"
                try:
                    st = os.lstat(root + rel)
                except OSError:
                    continue
                if _is(st, root + rel, ino, dev, handle):
                    cache[(ino, dev)] = rel
                    return rel
    seen = 0
    for top in dict.fromkeys([proc.cwd, "/"]):
        found = _walk(root, top, ino, dev, handle, seen)
        if isinstance(found, str):
            cache[(ino, dev)] = found
            return found
        seen = found
    return None


def _upper(init_hostpid: int) -> str | None:
    """The upper layer of the workspace's root (the overlay's upperdir), if it has one."""
    with open(f"/proc/{init_hostpid}/mountinfo") as fh:
        for line in fh:
            words = line.split()
            if words[4] == "/" and " - overlay " in line:
                options = line.rsplit(None, 1)[-1].split(",")
                return next((o[len("upperdir="):] for o in options if o.startswith("upperdir=")), None)
    return None


def _walk(root: str, top: str, ino: int, dev: int, handle: str, seen: int) -> str | int:
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
            if _is(st, p, ino, dev, handle):
                return p[len(root):] or "/"
        if seen > _WALK_LIMIT:
            break
    return seen


def _held(procs, ino: int, dev: int, handle: str) -> tuple[object, str] | None:
    """(process, /proc entry) of a descriptor or working directory of the workspace holding
    deleted inode (ino, dev), if any."""
    for p in procs:
        if p.is_init:
            continue
        entries = [f"fd/{g.fd}" for g in p.fds if g.ino == ino]
        if p.cwd.endswith(" (deleted)"):
            entries.append("cwd")
        for entry in entries:
            path = f"/proc/{p.hostpid}/{entry}"
            st = os.stat(path)
            if st.st_nlink == 0 and _is(st, path, ino, dev, handle, follow=True):
                return p, entry
    return None


def _mapped_only(procs, ino: int, dev: int, handle: str) -> str:
    """The path of deleted inode (ino, dev) if a mapping of the workspace is on it, else ""."""
    for p in procs:
        for line in maps_of(p).splitlines():
            words = line.split(maxsplit=5)
            if len(words) == 6 and int(words[4]) == ino and words[5].endswith(" (deleted)"):
                path = f"/proc/{p.hostpid}/map_files/{words[0]}"
                if _is(os.stat(path), path, ino, dev, handle, follow=True):
                    return words[5].strip()
    return ""


def check_tree(procs) -> None:
    """Find, at plan time, the path of each watched inode, or the holder of a deleted one, and
    refuse a watch with neither; log queued events."""
    root, upper = f"/proc/{procs[0].hostpid}/root", None
    cache: dict[tuple[int, int], str] = {}
    for p in procs:
        for f in p.fds:
            if f.handler is not OPS or f.dup_of is not None:
                continue
            if upper is None:
                upper = _upper(procs[0].hostpid) or ""
            f.inotify_held, f.inotify_paths = {}, {}
            watches, listed = _watches_listed(p.hostpid, f.fd)
            if len(watches) != listed:  # a format this fork cannot read: never a watch left out
                raise ForkError(f"process {p.vpid} ({p.name}) fd {f.fd}: inotify lists {listed} watches in "
                                f"fdinfo, {len(watches)} of them in a form this fork reads, so the child would "
                                "miss some", pid=p.hostpid, step="plan")
            if watches and watches[-1][0] - len(watches) > _MAX_HOLES:
                raise ForkError(f"process {p.vpid} ({p.name}) fd {f.fd}: inotify watch descriptors go up to "
                                f"{watches[-1][0]} for {len(watches)} watches; more than {_MAX_HOLES} removed "
                                "watches would each be made and removed again to keep the numbers",
                                pid=p.hostpid, step="plan")
            for wd, ino, dev, _, handle in watches:
                held = _held(procs, ino, dev, handle)
                if held is not None:
                    f.inotify_held[wd] = held
                    continue
                path = _path_of(root, upper, p, ino, dev, handle, cache)
                mapped = "" if path is not None else _mapped_only(procs, ino, dev, handle)
                if mapped:
                    raise ForkError(f"process {p.vpid} ({p.name}) fd {f.fd}: inotify watch {wd} is on {mapped}, "
                                    f"which only a mapping keeps (no descriptor or working directory of the "
                                    f"workspace holds it, so the child has no copy to watch): a fork cannot carry "
                                    f"it", pid=p.hostpid, step="plan")
                if path is None:
                    raise ForkError(f"process {p.vpid} ({p.name}) fd {f.fd}: inotify watch {wd} is on inode {ino}, "
                                    f"which has no path in the workspace (within {_WALK_LIMIT} entries) and, if "
                                    f"deleted, nothing of the workspace holds (something outside keeps it): a fork "
                                    f"cannot carry it", pid=p.hostpid, step="plan")
                f.inotify_paths[wd] = path
            queued = _queued(p.hostpid, f.fd)
            if queued:
                log.warning("process %d (%s) fd %d: inotify has %d bytes of unread events, which a fork cannot "
                            "copy (inotify has no peek and no way to queue an event): the child's queue starts "
                            "empty", p.vpid, p.name, f.fd, queued)


def _queued(hostpid: int, fd: int) -> int:
    """Bytes of events queued in a template inotify (FIONREAD reads nothing)."""
    dup = sharing.getfd_here(hostpid, fd)
    try:
        return struct.unpack("i", fcntl.ioctl(dup, termios.FIONREAD, b"\0" * 4))[0]
    finally:
        os.close(dup)


def fixup(ctx, proc, r, f) -> None:
    if sharing.reuse(ctx, "inotify", proc, r, f):
        return
    newfd = r.call("inotify_init1", os.O_CLOEXEC | (f.flags & os.O_NONBLOCK))
    ctx.shared.setdefault("inotify-made", []).append((r.t.pid, f.fd))
    held = getattr(f, "inotify_held", {})
    if held:  # watched through holders' copies: by the last holder's clone (fixup_proc)
        r.install(newfd, f)
        ctx.shared.setdefault("inotify-pending", []).append(
            ((proc.vpid, f.fd), proc, f, {p.hostpid for p, _ in held.values()}))
    else:
        _add_watches(ctx, proc, r, newfd, f)
        r.install(newfd, f)
    sharing.remember(ctx, "inotify", proc, f, f.fd)


def _add_watches(ctx, proc, r, fd: int, f) -> None:
    """The watches of template inotify ``f`` (of ``proc``) added to inotify ``fd`` of this
    clone, each with its wd."""
    held = getattr(f, "inotify_held", {})
    next_wd, holes, anchor = 1, False, -1
    for wd, _, _, mask, _ in _watches_handles(proc.hostpid, f.fd):
        if wd in held:
            holder, entry = held[wd]
            path, how = f"/proc/{holder.vpid}/{entry}", 0  # a /proc link: followed to the file
        else:
            # the path was found as the watched inode itself (lstat): a symlink watched is
            # that symlink, not what it points to
            path, how = f.inotify_paths[wd], _IN_DONT_FOLLOW
        while next_wd < wd:  # a removed watch left a hole: wds are handed out in order
            holes = True
            if anchor < 0:
                # a new inode, which no watch of the template is on, that the clone owns (the
                # instance's own is the host root's, which a sandbox's root may not read)
                anchor = r.call("memfd_create", r.path("inotify-hole"), _MFD_CLOEXEC)
            hole = r.call("inotify_add_watch", fd, r.path(f"/proc/self/fd/{anchor}"), 0x1)
            r.call("inotify_rm_watch", fd, hole)
            next_wd += 1
        got = r.call("inotify_add_watch", fd, r.path(path), mask & _KEPT | how)
        if got != wd:
            raise ForkError(f"process {proc.vpid} fd {f.fd}: inotify watch {wd} on {path} came back as {got}")
        next_wd = wd + 1
    if holes:
        r.queue("close", anchor)
        _drain(r, fd)  # removing the hole watches queued IN_IGNORED events


def fixup_proc(ctx, proc, r) -> None:
    """Fill the inotify instances whose holders are all cloned now."""
    done = ctx.shared.setdefault("inotify-done", set())
    done.add(proc.hostpid)
    pending = ctx.shared.get("inotify-pending", [])
    for item in [i for i in pending if i[3] <= done]:
        pending.remove(item)
        where, maker, f, _ = item
        fd = where[1] if where[0] == proc.vpid else sharing.grab(r, where)
        _add_watches(ctx, maker, r, fd, f)
        if fd != where[1]:
            r.call("close", fd)


def finish(ctx) -> None:
    """Refuse a fill never done; read away the events the fork's own file operations caused
    (a file reopened, a deleted one linked and unlinked) from each new instance."""
    if ctx.shared.pop("inotify-pending", []):
        raise ForkError("inotify watches on deleted files whose holders were not cloned", step="inotify")
    for clone, fd in ctx.shared.pop("inotify-made", []):
        copy = sharing.getfd_here(clone, fd)
        try:
            while readable(copy, 0):
                os.read(copy, 65536)
        finally:
            os.close(copy)


def _drain(r, fd: int) -> None:
    flags = r.call("fcntl", fd, 3, 0)  # F_GETFL
    r.call("fcntl", fd, 4, flags | os.O_NONBLOCK)
    buf = r.put(bytes(1024))
    while r.call("read", fd, buf, 1024, ok_errnos=(11,)) > 0:  # EAGAIN: empty
        pass
    r.call("fcntl", fd, 4, flags)


OPS = SimpleNamespace(kind="inotify", claims=claims, fixup=fixup, check_tree=check_tree)
PROC = SimpleNamespace(kind="inotify-watches", plan_proc=lambda proc: None, fixup_proc=fixup_proc, finish=finish)
