"""Regular files, directories and O_PATH descriptors of the workspace: reopened by path in the
child's root (its own overlay) with the same flags and offset. A deleted-but-open file gets a
private copy with the same mode and owner (one copy for all its opens), made at its path,
opened and removed; a deleted directory (or symlink, held O_PATH) is made again at its path,
opened and removed; a deleted working directory too (CWD). For a clone that may not make
them there (sharing.by_trainer) the trainer makes them in the child's root."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from types import SimpleNamespace

from ...errors import ForkError
from ...runtime.userns import owner_inside
from ..plan import kind_of
from ..remote import ANY_ERROR
from . import sharing, shmem

_DELETED = " (deleted)"
_O_TMPFILE = 0o20000000 | os.O_DIRECTORY
_AT_FDCWD = -100 & 0xFFFFFFFFFFFFFFFF
_AT_SYMLINK_NOFOLLOW, _AT_REMOVEDIR = 0x100, 0x200
# open() takes these but they act once, at the open, and the file was there already
_NOT_KEPT = os.O_CREAT | os.O_TRUNC | os.O_EXCL
# a new file at a name the plan found free, never through a symlink made there since
_AT_PATH_CREATE = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW


def claims(proc, f) -> bool:
    return (stat.S_ISREG(f.mode) or stat.S_ISDIR(f.mode)) and f.target.startswith("/")


def claims_path(proc, f) -> bool:
    """O_PATH descriptors of anything with a path (a symlink opened O_NOFOLLOW, a FIFO, a
    device...): opening one only looks the path up, so it is reopened like a file. One of a
    memfd or of shared anonymous memory is shmem.py's (the child's copy of the object)."""
    return (bool(f.flags & os.O_PATH) and f.target.startswith("/") and not shmem.claims_fd(proc, f))


def _refuse(proc, f, why: str) -> ForkError:
    return ForkError(f"process {proc.vpid} ({proc.name}) fd {f.fd} is a deleted {kind_of(f)} "
                     f"({f.target}): {why}", pid=proc.hostpid, step="plan")


def way_to(root: str, target: str) -> tuple[list[str] | None, str]:
    """The directories to make, outermost first, so that a deleted ``target`` can be made again
    at its path in a child of the template whose root is ``root`` (made, then removed after
    it, they are as deleted as in the template); None and why when it cannot be."""
    path = target[: -len(_DELETED)]
    missing: list[str] = []
    d = os.path.dirname(path)
    while not os.path.lexists(root + d):
        missing.insert(0, d)
        d = os.path.dirname(d)
    if not stat.S_ISDIR(os.lstat(root + d).st_mode):
        return None, f"{d} is not a directory now, so it cannot be made again at its path"
    if not missing and os.path.lexists(root + path):
        return None, "something else is at its path now, so it cannot be made again there"
    return missing, ""


def make_way(r, way: list[str]) -> None:
    for d in way:
        r.queue("mkdirat", _AT_FDCWD, r.queue_path(d), 0o700)


def drop_way(r, way: list[str]) -> None:
    for d in reversed(way):
        r.queue("unlinkat", _AT_FDCWD, r.queue_path(d), _AT_REMOVEDIR)


def check_tree(procs) -> None:
    """Refuse, at plan time, deleted things that cannot be made again faithfully."""
    root = f"/proc/{procs[0].hostpid}/root"
    found: dict = {}  # (ino, dev) -> path, for inotify._path_of
    for p in procs:
        for f in p.fds:
            if f.handler not in (OPS, PATHS) or f.dup_of is not None or not f.target.endswith(_DELETED):
                continue
            if stat.S_ISDIR(f.mode) or stat.S_ISLNK(f.mode):
                f.way, why = way_to(root, f.target)
                if f.way is None:
                    raise _refuse(p, f, why)
            elif stat.S_ISREG(f.mode):
                f.way = way_to(root, f.target)[0]  # None: a copy under another name
                if os.stat(f"/proc/{p.hostpid}/fd/{f.fd}").st_nlink:
                    f.other_name = _other_name(root, p, f, found)
            else:
                raise _refuse(p, f, "only deleted files, directories and symlinks can be made again")


def _other_name(root: str, proc, f, found: dict) -> str:
    """The name a file removed from ``f``'s path still has (another hard link): the child's
    descriptor must be of the child's file by that name, where a write shows, not a copy."""
    from .inotify import _handle, _path_of, _upper

    held = f"/proc/{proc.hostpid}/fd/{f.fd}"
    path = _path_of(root, _upper(proc.hostpid), proc, f.ino, f.dev, _handle(held, True), found)
    if path is None:
        raise _refuse(proc, f, "the file has another name (hard link), not found in the workspace, "
                      "so the child's copy would not be the file by that name")
    return path


def fixup(ctx, proc, r, f) -> None:
    if sharing.take_shared(proc, r, f):
        return
    flags = f.flags & ~_NOT_KEPT | os.O_NOCTTY
    if f.target.endswith(_DELETED) and stat.S_ISDIR(f.mode):
        newfd = _remake_dir(proc, r, f.target[: -len(_DELETED)], flags, os.stat(f"/proc/{proc.hostpid}/fd/{f.fd}"),
                            f.way, f"fd {f.fd}: deleted directory {f.target}")
    elif f.target.endswith(_DELETED) and stat.S_ISLNK(f.mode):  # O_PATH | O_NOFOLLOW
        newfd = _remake_symlink(proc, r, f, flags)
    elif getattr(f, "other_name", None) is not None:
        newfd = _open_linked(proc, r, f, flags)
    elif f.target.endswith(_DELETED):
        made = ctx.shared.setdefault("deleted-files", {})
        if (f.dev, f.ino) in made:  # another open of the same file: of the same copy
            vpid, fd = made[f.dev, f.ino]
            newfd = sharing.queue_open(r, proc, f"/proc/{vpid}/fd/{fd}", flags & ~os.O_NOFOLLOW)
        else:
            newfd = _copy_deleted(proc, r, f, flags)
            made[f.dev, f.ino] = (proc.vpid, f.fd)
    else:
        newfd = sharing.queue_open(r, proc, f.target, flags)
    if f.pos:  # a directory's is an opaque cookie: replayed as getdents would
        r.queue("lseek", newfd, f.pos, os.SEEK_SET)
    r.install(newfd, f)


def _open_linked(proc, r, f, flags: int):
    """The child's file by its other name, opened with ``flags``: linked at the removed name
    while it is opened, so /proc names it alike, where that name is free (plan: a way to it),
    the clone may make it there and the file system takes the link; else opened by the other
    name."""
    path = f.target[: -len(_DELETED)]
    if f.way is None or sharing.by_trainer(proc):
        return sharing.queue_open(r, proc, f.other_name, flags)
    make_way(r, f.way)
    linked = r.queue("linkat", _AT_FDCWD, r.queue_path(f.other_name), _AT_FDCWD, r.queue_path(path), 0,
                     ok_errnos=ANY_ERROR)
    if linked.value < 0:
        drop_way(r, f.way)  # another mount (EXDEV), a read-only one
        return sharing.queue_open(r, proc, f.other_name, flags)
    newfd = r.queue_openat(path, flags)
    r.queue("unlinkat", _AT_FDCWD, r.queue_path(path), 0)
    drop_way(r, f.way)
    return newfd


def _owner(proc, r, fd, st: os.stat_result) -> None:
    """``fd``'s file gets ``st``'s owner and mode: by the clone, or by the trainer where the
    clone may not give a file away (sharing.by_trainer)."""
    if sharing.by_trainer(proc):
        held = f"/proc/{r.t.pid}/fd/{sharing.number(fd)}"
        os.chown(held, st.st_uid, st.st_gid)
        os.chmod(held, stat.S_IMODE(st.st_mode))
        return
    r.queue("fchown", fd, *owner_inside(r.t.pid, st))  # first: it drops set-user-ID
    r.queue("fchmod", fd, stat.S_IMODE(st.st_mode))  # not the umask-cut mode it was made with


def _remake_dir(proc, r, path: str, flags: int, st: os.stat_result, way: list[str], what: str):
    """A directory made at ``path`` (after ``way``), opened with ``flags`` and removed: the
    process sees it deleted, with its mode and owner. By the trainer where the clone may not
    make it (sharing.by_trainer)."""
    if sharing.by_trainer(proc):
        with in_childs_root(proc, r, what, path, way) as (parent, name):
            os.mkdir(name, 0o700, dir_fd=parent)
            try:
                helper = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=parent)
                try:
                    os.fchown(helper, st.st_uid, st.st_gid)
                    os.fchmod(helper, stat.S_IMODE(st.st_mode))
                finally:
                    os.close(helper)
                return sharing.open_for(r, path, flags)
            finally:
                os.rmdir(name, dir_fd=parent)
    make_way(r, way)
    r.queue("mkdirat", _AT_FDCWD, r.queue_path(path), 0o700)
    helper = r.queue_openat(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    _owner(proc, r, helper, st)
    newfd = sharing.queue_open(r, proc, path, flags)
    r.queue("unlinkat", _AT_FDCWD, r.queue_path(path), _AT_REMOVEDIR)
    drop_way(r, way)
    r.queue("close", helper)
    return newfd


def _remake_symlink(proc, r, f, flags: int):
    """A symlink made again at its path with what it holds, opened and removed."""
    path = f.target[: -len(_DELETED)]
    held = sharing.getfd_here(proc.hostpid, f.fd)
    try:
        content = os.readlink("", dir_fd=held)
        st = os.fstat(held)
    finally:
        os.close(held)
    if sharing.by_trainer(proc):
        with in_childs_root(proc, r, f"fd {f.fd}: deleted symlink {f.target}", path, f.way) as (parent, name):
            os.symlink(content, name, dir_fd=parent)
            try:
                os.chown(name, st.st_uid, st.st_gid, dir_fd=parent, follow_symlinks=False)
                return sharing.open_for(r, path, flags)
            finally:
                os.unlink(name, dir_fd=parent)
    make_way(r, f.way)
    r.queue("symlinkat", r.queue_path(content), _AT_FDCWD, r.queue_path(path))
    r.queue("fchownat", _AT_FDCWD, r.queue_path(path), *owner_inside(r.t.pid, st), _AT_SYMLINK_NOFOLLOW)
    newfd = r.queue_openat(path, flags)
    r.queue("unlinkat", _AT_FDCWD, r.queue_path(path), 0)
    drop_way(r, f.way)
    return newfd


def _copy_deleted(proc, r, f, flags: int):
    """An unlinked file lives only in the template; the child gets its own unlinked copy,
    with the file's mode and owner, opened with its flags. Where its name is free (plan: a way
    to it), the copy is made at that name, opened and unlinked, so /proc shows the same name
    (O_TMPFILE is not asked for: overlayfs has it only from Linux 6.6); by the trainer, in the
    child's root, for a clone that may not write there (sharing.by_trainer). Elsewhere it is
    an O_TMPFILE (_tmpfile), which /proc names by its inode number."""
    path = f.target[: -len(_DELETED)]
    way = getattr(f, "way", None)
    if way is not None and sharing.by_trainer(proc):
        return _copy_at_path_by_trainer(proc, r, f, path, way, flags)
    if way is not None:
        make_way(r, way)
        tmp = r.call("openat", _AT_FDCWD, r.path(path), _AT_PATH_CREATE | os.O_RDWR | os.O_CLOEXEC, 0o600,
                     ok_errnos=ANY_ERROR)
        if tmp < 0:  # a file system that takes no new file (read-only): the copy goes elsewhere
            drop_way(r, way)
            way = None
    if way is None:
        tmp = _tmpfile(proc, r, f, os.path.dirname(path) or "/")
    with open(f"/proc/{proc.hostpid}/fd/{f.fd}", "rb") as src, \
            open(f"/proc/{r.t.pid}/fd/{tmp}", "r+b") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
        st = os.fstat(src.fileno())
    _owner(proc, r, tmp, st)
    if way is not None:
        newfd = sharing.queue_open(r, proc, path, flags)
        r.queue("unlinkat", _AT_FDCWD, r.queue_path(path), 0)
        drop_way(r, way)
    else:  # O_NOFOLLOW would refuse the /proc link: the only flag not carried then
        newfd = sharing.queue_open(r, proc, f"/proc/self/fd/{tmp}", flags & ~os.O_NOFOLLOW)
    r.queue("close", tmp)
    return newfd


def _tmpfile(proc, r, f, parent: str) -> int:
    """An unnamed file for a copy of ``f`` in the clone behind ``r``: in its directory
    ``parent`` where the file system and the clone's rights allow."""
    for d in (parent, "/tmp", "/dev/shm"):
        tmp = r.call("openat", _AT_FDCWD, r.path(d), _O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600,
                     ok_errnos=ANY_ERROR)
        if tmp >= 0:
            return tmp
    raise ForkError(f"process {proc.vpid} fd {f.fd}: no place for a copy of deleted file {f.target}",
                    pid=proc.hostpid, step="fixup")


def _copy_at_path_by_trainer(proc, r, f, path: str, way: list[str], flags: int) -> int:
    """_copy_deleted's copy made by the trainer at ``path`` in the child's root, opened with
    ``flags``, handed over (sharing.open_for) and unlinked."""
    with in_childs_root(proc, r, f"fd {f.fd}: deleted file {f.target}", path, way) as (parent, name):
        copy = os.open(name, _AT_PATH_CREATE | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=parent)
        try:
            with open(f"/proc/{proc.hostpid}/fd/{f.fd}", "rb") as src, open(copy, "r+b", closefd=False) as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
                st = os.fstat(src.fileno())
            os.fchown(copy, st.st_uid, st.st_gid)  # first: it drops set-user-ID
            os.fchmod(copy, stat.S_IMODE(st.st_mode))
            return sharing.open_for(r, path, flags)
        finally:
            os.close(copy)
            os.unlink(name, dir_fd=parent)


@contextlib.contextmanager
def in_childs_root(proc, r, what: str, path: str, way: list[str]):
    """For the trainer, which makes a deleted thing again at ``path`` in the child's root for
    a clone that may not (it runs under another uid, in a directory it cannot write, or
    dropped CAP_DAC_OVERRIDE): the directory ``path`` goes in (made after the directories
    ``way``, removed again after) and the name to give it there. Its failures are ForkErrors
    saying ``what``."""
    r.flush()  # what the clone has queued in its root comes first
    made: list[str] = []
    try:
        try:
            for d in way:
                with _dir_in_root(r.t.pid, os.path.dirname(d)) as parent:
                    os.mkdir(os.path.basename(d), 0o700, dir_fd=parent)
                made.append(d)
            with _dir_in_root(r.t.pid, os.path.dirname(path)) as parent:
                yield parent, os.path.basename(path)
        finally:
            for d in reversed(made):
                with _dir_in_root(r.t.pid, os.path.dirname(d)) as parent:
                    os.rmdir(os.path.basename(d), dir_fd=parent)
    except OSError as e:
        raise ForkError(f"process {proc.vpid} ({proc.name}) {what}, made again for it by the trainer: "
                        f"{e.strerror}", pid=proc.hostpid, step="fixup", errno=e.errno) from None


@contextlib.contextmanager
def _dir_in_root(hostpid: int, path: str):
    """A descriptor of directory ``path`` as process ``hostpid`` sees it (in its root)."""
    fd = sharing.open_in_root(hostpid, path, os.O_PATH | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


def plan_proc(proc) -> None:
    if proc.cwd.endswith(_DELETED):
        proc.cwd_stat = os.stat(f"/proc/{proc.hostpid}/cwd")


def check_cwd(procs) -> None:
    root = f"/proc/{procs[0].hostpid}/root"
    for p in procs:
        if p.cwd.endswith(_DELETED) and not p.is_init:
            p.cwd_way, why = way_to(root, p.cwd)
            if p.cwd_way is None:
                raise ForkError(f"process {p.vpid} ({p.name}) works in a deleted directory ({p.cwd}): {why}",
                                pid=p.hostpid, step="plan")


def fixup_proc(ctx, proc, r) -> None:
    """A deleted working directory: made again at its path, entered and removed."""
    st = getattr(proc, "cwd_stat", None)
    if st is None:
        return
    path = proc.cwd[: -len(_DELETED)]
    helper = _remake_dir(proc, r, path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, st, proc.cwd_way,
                         f"working directory {proc.cwd}")
    r.queue("fchdir", helper)
    r.queue("close", helper)


OPS = SimpleNamespace(kind="file", claims=claims, fixup=fixup, check_tree=check_tree)
PATHS = SimpleNamespace(kind="path", claims=claims_path, fixup=fixup)
CWD = SimpleNamespace(kind="cwd", plan_proc=plan_proc, fixup_proc=fixup_proc, check_tree=check_cwd)
