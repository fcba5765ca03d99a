"""The plan half of a fork: read a frozen workspace's process tree from /proc and decide, for
every process and descriptor, which resource handler recreates it in a child.

Nothing here touches the processes; a plan is made once per template and reused by every fork.
"""

from __future__ import annotations

import functools
import os
import stat
from dataclasses import dataclass, field
from types import SimpleNamespace

from ..errors import ForkError


@dataclass
class Lock:
    """A file lock as /proc/PID/fdinfo shows it under the descriptor that set it."""

    kind: str  # POSIX (owned by the process), OFDLCK or FLOCK (owned by the open file), LEASE...
    write: bool
    start: int
    end: int  # the last byte, -1: to the end of the file, however long it grows


@dataclass
class FdInfo:
    """One open descriptor of a template process."""

    fd: int
    target: str  # readlink of /proc/PID/fd/N: a path inside the workspace, or "pipe:[ino]"...
    mode: int  # st_mode of what it refers to
    flags: int  # from fdinfo: open flags, O_CLOEXEC included
    pos: int
    ino: int
    dev: int
    handler: SimpleNamespace | None = None  # the resource ops that own it (set by plan_tree)
    dup_of: int | None = None  # an earlier fd of the same process sharing the open file
    # FD_CLOEXEC, None: ask the first fork's clone (frozen, it cannot change). fdinfo's flags
    # show O_CLOEXEC when the descriptor has it, but also when only the file has it in its own
    # flags (eventfd, epoll, inotify, timerfd... made with *_CLOEXEC keep it there, as open()
    # did before Linux 5.6, and a dup without FD_CLOEXEC still shows it): only its absence is
    # sure.
    cloexec: bool | None = None
    locks: list[Lock] = field(default_factory=list)  # the locks set through it (fdinfo)


@dataclass
class ProcPlan:
    """One process of the template, as the child must get it."""

    hostpid: int
    vpid: int
    ppid: int  # in the workspace's namespace
    pgid: int
    sid: int
    threads: list[int]  # host tids, main thread first
    cwd: str
    fds: list[FdInfo] = field(default_factory=list)
    is_init: bool = False
    seccomp_filters: int = 0  # seccomp filters it runs under
    ctty: int | None = None  # index of its controlling pty (/dev/pts/N), if it has one
    exit_signal: int = 17  # what its death sends its parent (SIGCHLD, but for clone()'s own choice)
    uid: int = 0  # effective, as the host sees it
    cap_eff: int = (1 << 64) - 1  # its main thread's effective capabilities
    # stopped by a signal (kill -STOP, Ctrl-Z) when last seized (seize.seize_all): its clones
    # are stopped too
    group_stopped: bool = False

    @functools.cached_property
    def name(self) -> str:
        """The process's comm, for messages (read once: a template process never runs again)."""
        try:
            with open(f"/proc/{self.hostpid}/comm") as f:
                return f.read().strip()
        except OSError:
            return "?"


def proc_status(pid: int | str) -> dict[str, str]:
    """/proc/PID/status as a dict (PID may be "self")."""
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def seccomp_filters(status: dict[str, str]) -> int:
    """How many seccomp filters a task runs under, from its /proc status (before Linux 5.9,
    which has no count: 1 for any)."""
    if "Seccomp_filters" in status:
        return int(status["Seccomp_filters"])
    return 1 if status.get("Seccomp", "0").strip() == "2" else 0


def _fdinfo(pid: int, fd: int) -> tuple[dict[str, str], list[Lock]]:
    """The fields of /proc/PID/fdinfo/FD, and its locks ("lock:" lines, one per lock)."""
    with open(f"/proc/{pid}/fdinfo/{fd}") as f:
        lines = [line.split(":", 1) for line in f if ":" in line]
    locks = []
    for key, value in lines:
        if key == "lock":  # "1: POSIX  ADVISORY  WRITE 29847 fe:00:2163341 3 EOF"
            words = value.split()
            locks.append(Lock(kind=words[1], write=words[3] == "WRITE", start=int(words[-2]),
                              end=-1 if words[-1] == "EOF" else int(words[-1])))
    return dict(lines), locks


def _ns_ppid(host_ppid: int, level: int) -> int:
    """The parent's pid in the workspace's namespace (``level`` deep), 0 when it is outside."""
    try:
        nspid = proc_status(host_ppid)["NSpid"].split() if host_ppid > 0 else []
    except (OSError, KeyError):
        return 0
    return int(nspid[-1]) if len(nspid) == level else 0


def _pty_index(tty_nr: int) -> int | None:
    """The /dev/pts index of a tty_nr from /proc/PID/stat; None for any other terminal."""
    major, minor = (tty_nr >> 8) & 0xFFF, (tty_nr & 0xFF) | ((tty_nr >> 12) & 0xFFF00)
    if 136 <= major <= 143:  # UNIX98_PTY_SLAVE_MAJOR and its 7 siblings
        return (major - 136) * 256 + minor
    return None


def read_proc(hostpid: int) -> ProcPlan:
    """Everything the engine needs to know about one (stopped) process."""
    st = proc_status(hostpid)
    with open(f"/proc/{hostpid}/stat", "rb") as f:
        raw = f.read()
    rest = raw[raw.rindex(b")") + 2 :].split()
    nspid = [int(x) for x in st["NSpid"].split()]
    vpid = nspid[-1]
    tids = sorted(int(t) for t in os.listdir(f"/proc/{hostpid}/task"))
    tids.remove(hostpid)
    plan = ProcPlan(
        hostpid=hostpid,
        vpid=vpid,
        ppid=_ns_ppid(int(st["PPid"]), len(nspid)),  # PPid is the host's pid
        pgid=int(st["NSpgid"].split()[-1]),
        sid=int(st["NSsid"].split()[-1]),
        threads=[hostpid, *tids],
        cwd=os.readlink(f"/proc/{hostpid}/cwd"),
        is_init=vpid == 1,
        seccomp_filters=seccomp_filters(st),
        ctty=_pty_index(int(rest[4])),  # after the comm: state ppid pgrp session tty_nr
        exit_signal=int(rest[35]),  # stat's field 38
        uid=int(st["Uid"].split()[1]),
        cap_eff=int(st["CapEff"], 16),
    )
    for name in os.listdir(f"/proc/{hostpid}/fd"):
        fd = int(name)
        try:
            target = os.readlink(f"/proc/{hostpid}/fd/{fd}")
            s = os.stat(f"/proc/{hostpid}/fd/{fd}")
            info, locks = _fdinfo(hostpid, fd)
        except FileNotFoundError:
            continue
        flags = int(info["flags"], 8)
        plan.fds.append(FdInfo(fd=fd, target=target, mode=s.st_mode, flags=flags,
                               pos=int(info["pos"]), ino=s.st_ino, dev=s.st_dev,
                               cloexec=None if flags & os.O_CLOEXEC else False, locks=locks))
    plan.fds.sort(key=lambda f: f.fd)
    return plan


class VforkInFlight(ForkError):
    """A process shares its memory with its parent without being its thread: a vfork() (or
    posix_spawn) whose child has not called exec or _exit yet. The parent cannot reach a ptrace
    stop until its child does (it waits killable, not interruptible), and one address space
    cannot become two in a fork: the snapshot waits for the exec (template.snapshot_body)."""

    def __init__(self, pairs: list[tuple[ProcPlan, ProcPlan]]) -> None:
        parent, child = pairs[0]
        super().__init__(
            f"process {parent.vpid} ({parent.name}) is in vfork(): its child {child.vpid} "
            f"({child.name}) shares its memory and has not called exec or _exit",
            pid=child.hostpid, step="snapshot")
        self.pairs = pairs


def vfork_pairs(procs: list[ProcPlan]) -> list[tuple[ProcPlan, ProcPlan]]:
    """(parent, child) of every process sharing its parent's address space (see VforkInFlight).
    Only parents are compared: CLONE_VM without CLONE_PARENT is the only way to get there."""
    from .._core._syscalls import KCMP_VM, kcmp

    by_vpid = {p.vpid: p for p in procs}
    pairs = []
    for p in procs:
        parent = by_vpid.get(p.ppid)
        if parent is None:
            continue
        try:
            if kcmp(parent.hostpid, p.hostpid, KCMP_VM, 0, 0) == 0:
                pairs.append((parent, p))
        except OSError:  # no kcmp (CONFIG_KCMP off), or one of them is gone
            pass
    return pairs


# A process is cloned into a child from inside itself (an injected clone3, or the module's
# FORK in its context), and its clone enters the child's namespaces with its own system calls:
# setns(pid, mnt, ...) and clone3's set_tid check these capabilities of the process.
CLONE_CAPS = (("CAP_SYS_ADMIN", 21), ("CAP_SYS_CHROOT", 18))


def check_caps(procs: list[ProcPlan]) -> None:
    """Refuse, before anything is made, a process that could not clone itself into a child:
    one that dropped the capabilities of CLONE_CAPS (a program that switched to another user,
    a capability bounding set), where the fork's clones enter the child by their own system
    calls (Cloner.clone_enters_child). Where the kernel places them (the module's FORK) such a
    process is forked as any other."""
    from .cloners import cloner

    for p in procs:
        missing = [name for name, bit in CLONE_CAPS if not p.cap_eff >> bit & 1]
        if not missing:
            continue
        cl = cloner()
        if not cl.clone_enters_child:
            return
        raise ForkError(
            f"process {p.vpid} ({p.name}) runs as uid {p.uid} without {' and '.join(missing)}: "
            f"this fork ({cl.name}) clones each process from inside it, and the clone enters "
            "the child's namespaces and takes its pid there with system calls that need them "
            "(clone3 set_tid, setns), so this workspace cannot be forked here. The kernel module's "
            "FORK (bunshin.ko 0.5.0 or later, kmod/) places each clone in the child itself and "
            "forks such a process; without it, keep those capabilities in the workspace's programs "
            "(they run as root with them by default), or end that process before forking",
            pid=p.hostpid, step="snapshot")


_KCMP_FILES = 2  # include/uapi/linux/kcmp.h: the same descriptor table


def check_fd_tables(procs: list[ProcPlan]) -> None:
    """Refuse two processes that share one descriptor table (clone() with CLONE_FILES and
    without CLONE_THREAD): a clone is made from inside its own process, so it gets a table of
    its own, and no system call makes a process take another's table (unshare only leaves
    one; pidfd_getfd copies a descriptor, not the table), so the sharing would be lost.
    Processes sharing a table have the same descriptor numbers: only those are compared."""
    from .._core._syscalls import kcmp

    by_fds: dict[tuple[int, ...], list[ProcPlan]] = {}
    for p in procs:
        by_fds.setdefault(tuple(f.fd for f in p.fds), []).append(p)
    for same in by_fds.values():
        for i, a in enumerate(same):
            for b in same[i + 1:]:
                try:
                    shared = kcmp(a.hostpid, b.hostpid, _KCMP_FILES, 0, 0) == 0
                except OSError:  # no kcmp (CONFIG_KCMP off), or one of them is gone
                    continue
                if shared:
                    raise ForkError(
                        f"processes {a.vpid} ({a.name}) and {b.vpid} ({b.name}) share one "
                        "descriptor table (clone with CLONE_FILES): each clone of a fork gets a "
                        "table of its own, as no system call makes a process take another's, so "
                        "a descriptor one of them opens or closes would no longer be seen by the "
                        "other; end one of them before forking", pid=b.hostpid, step="plan")


def plan_tree(hostpids: list[int]) -> list[ProcPlan]:
    """Plans for every process, init first; raises ForkError for what no handler supports
    (VforkInFlight for a vfork not over yet)."""
    from . import resources
    from .._core._syscalls import KCMP_FILE, kcmp

    procs = sorted((read_proc(p) for p in hostpids), key=lambda p: p.vpid)
    if not procs or not procs[0].is_init:
        raise ForkError("the workspace has no init process; it cannot be forked")
    pairs = vfork_pairs(procs)
    if pairs:
        raise VforkInFlight(pairs)
    check_caps(procs)
    check_fd_tables(procs)
    for p in procs:
        for i, f in enumerate(p.fds):
            # Descriptors dup()ed inside one process share one open file: keep that.
            for g in p.fds[:i]:
                if g.dup_of is None and g.ino == f.ino and g.dev == f.dev:
                    try:
                        if kcmp(p.hostpid, p.hostpid, KCMP_FILE, g.fd, f.fd) == 0:
                            f.dup_of = g.fd
                            break
                    except OSError:
                        pass
            f.handler = resources.handler_for(p, f)
    resources.check_tree(procs)
    resources.plan_procs(procs)
    return procs


def kind_of(f: FdInfo) -> str:
    """A short human name for a descriptor's kind, for error messages."""
    if f.target.startswith("socket:"):
        return "socket"
    if f.target.startswith("anon_inode:"):
        return f.target.split(":", 1)[1].strip("[]")
    if f.target.startswith("pipe:"):
        return "pipe"
    m = f.mode
    for test, name in ((stat.S_ISREG, "file"), (stat.S_ISDIR, "directory"), (stat.S_ISCHR, "char device"),
                       (stat.S_ISFIFO, "fifo"), (stat.S_ISBLK, "block device"), (stat.S_ISLNK, "symlink"),
                       (stat.S_ISSOCK, "socket file")):
        if test(m):
            return name
    return "unknown"
