"""The plan half of a fork: read a frozen workspace's process tree from /proc and decide, for
every process and descriptor, which resource handler recreates it in a child.

Nothing here touches the processes; a plan is made once per template and reused by every fork.
"""

from __future__ import annotations

import functools
import itertools
import os
import stat
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from types import SimpleNamespace

from ..errors import ForkError
from ..runtime.userns import inside


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
    # (vpid, fd) of the first descriptor of an earlier process sharing the open file (inherited
    # across fork(): one offset, one set of status flags), found by plan_tree (_shared_across)
    shared_from: tuple[int, int] | None = None
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
    umask: int = 0o022
    handled: tuple[str, str] = ("", "")  # SigIgn and SigCgt of /proc/PID/status: its handlers' state
    vm_size: str = ""  # VmSize of /proc/PID/status ("" without an address space)
    # its clones are transplants (fork/transplant.py, check_caps): root until their last fixup
    transplanted: bool = False
    exiting: bool = False  # on its way out (PF_EXITING): the plan is made again once it is gone
    # when the fork's first seize stopped it: a blocked call's time left, written then, is
    # counted down from it (resources/threads.py)
    stopped_at: float | None = None
    # /proc/PID files planning read (status_of, maps_of): read once for every module that asks,
    # the process being frozen meanwhile, and dropped once the plan is made (plan_tree)
    reads: dict = field(default_factory=dict, repr=False)

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
    # read whole and split once: a fork reads several per process, and a text-mode file
    # iterated line by line costs ~1.6x as much
    text = read_text(f"/proc/{pid}/status")
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def status_of(proc: ProcPlan) -> dict[str, str]:
    """``proc``'s /proc/PID/status, as read by its plan."""
    st = proc.reads.get("status")
    if st is None:
        st = proc.reads["status"] = proc_status(proc.hostpid)
    return st


def maps_of(proc: ProcPlan) -> str:
    """``proc``'s /proc/PID/maps, read once while it is planned."""
    text = proc.reads.get("maps")
    if text is None:
        text = proc.reads["maps"] = read_text(f"/proc/{proc.hostpid}/maps")
    return text


def read_text(path: str) -> str:
    """A small /proc file whole, with no buffered file object around it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        parts = []
        while part := os.read(fd, 16384):
            parts.append(part)
    finally:
        os.close(fd)
    return b"".join(parts).decode()


def seccomp_filters(status: dict[str, str]) -> int:
    """How many seccomp filters a task runs under, from its /proc status (before Linux 5.9,
    which has no count: 1 for any)."""
    if "Seccomp_filters" in status:
        return int(status["Seccomp_filters"])
    return 1 if status.get("Seccomp", "0").strip() == "2" else 0


def _fdinfo(pid: int, fd: int) -> tuple[dict[str, str], list[Lock]]:
    """The fields of /proc/PID/fdinfo/FD, and its locks ("lock:" lines, one per lock)."""
    lines = [line.split(":", 1) for line in read_text(f"/proc/{pid}/fdinfo/{fd}").splitlines(True)
             if ":" in line]
    locks = []
    for key, value in lines:
        if key == "lock":  # "1: POSIX  ADVISORY  WRITE 29847 fe:00:2163341 3 EOF"
            words = value.split()
            locks.append(Lock(kind=words[1], write=words[3] == "WRITE", start=int(words[-2]),
                              end=-1 if words[-1] == "EOF" else int(words[-1])))
    return dict(lines), locks


def _ns_ppid(host_ppid: int, level: int, statuses: dict[int, dict[str, str]]) -> int:
    """The parent's pid in the workspace's namespace (``level`` deep), 0 when it is outside
    (``statuses``: those read already, by host pid)."""
    try:
        st = statuses.get(host_ppid) or proc_status(host_ppid) if host_ppid > 0 else {}
        nspid = st["NSpid"].split() if st else []
    except (OSError, KeyError):
        return 0
    return int(nspid[-1]) if len(nspid) == level else 0


def _pty_index(tty_nr: int) -> int | None:
    """The /dev/pts index of a tty_nr from /proc/PID/stat; None for any other terminal."""
    major, minor = (tty_nr >> 8) & 0xFFF, (tty_nr & 0xFF) | ((tty_nr >> 12) & 0xFFF00)
    if 136 <= major <= 143:  # UNIX98_PTY_SLAVE_MAJOR and its 7 siblings
        return (major - 136) * 256 + minor
    return None


def read_proc(hostpid: int, statuses: dict[int, dict[str, str]] | None = None) -> ProcPlan:
    """Everything the engine needs to know about one (stopped) process (``statuses``: the
    /proc/PID/status of the processes planned with it, by host pid)."""
    statuses = statuses or {}
    st = statuses.get(hostpid) or proc_status(hostpid)
    with open(f"/proc/{hostpid}/stat", "rb") as f:
        raw = f.read()
    rest = raw[raw.rindex(b")") + 2 :].split()
    nspid = [int(x) for x in st["NSpid"].split()]
    vpid = nspid[-1]
    tids = sorted(int(t) for t in os.listdir(f"/proc/{hostpid}/task"))
    tids.remove(hostpid)
    # after the comm: state ppid pgrp session tty_nr tpgid flags; a main thread that exited
    # before its process's other threads is a zombie, and its process lives on. One frozen
    # with a SIGKILL pending (its own queue shows a group kill too) dies as soon as it runs.
    # A process that died since the cgroup listed it (a zombie with no thread left) is one too:
    # its parent reaps it while the workspace runs.
    exiting = (bool(int(rest[6]) & _PF_EXITING) and (rest[0] != b"Z" or not tids)
               or bool(int(st["SigPnd"], 16) & _SIGKILL_BIT))
    try:
        cwd = os.readlink(f"/proc/{hostpid}/cwd")
    except FileNotFoundError:
        if not exiting:
            raise
        cwd = ""  # dropped on its way out: the plan is made again once it is gone
    plan = ProcPlan(
        hostpid=hostpid,
        vpid=vpid,
        # PPid is the host's pid; a pid namespace's init has its parent outside it
        ppid=0 if vpid == 1 else _ns_ppid(int(st["PPid"]), len(nspid), statuses),
        pgid=int(st["NSpgid"].split()[-1]),
        sid=int(st["NSsid"].split()[-1]),
        threads=[hostpid, *tids],
        cwd=cwd,
        is_init=vpid == 1,
        seccomp_filters=seccomp_filters(st),
        ctty=_pty_index(int(rest[4])),  # after the comm: state ppid pgrp session tty_nr
        exit_signal=int(rest[35]),  # stat's field 38
        uid=int(st["Uid"].split()[1]),
        cap_eff=int(st["CapEff"], 16),
        umask=int(st.get("Umask", "0022"), 8),
        handled=(st["SigIgn"], st["SigCgt"]),
        vm_size=st.get("VmSize", ""),
    )
    plan.reads["status"] = st
    plan.exiting = exiting
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


class Unsettled(ForkError):
    """A process in a passing state a fork cannot copy: the plan is made again once it is over
    (template._plan_settled), for a while (``wait_for``: what to do after it)."""

    wait_for = ""


class VforkInFlight(Unsettled):
    """A process shares its memory with its parent without being its thread: a vfork() (or
    posix_spawn) whose child has not called exec or _exit yet. The parent cannot reach a ptrace
    stop until its child does (it waits killable, not interruptible), and one address space
    cannot become two in a fork: the snapshot waits for the exec (template.snapshot_body)."""

    wait_for = "fork once it has (a vfork child should exec at once)"

    def __init__(self, pairs: list[tuple[ProcPlan, ProcPlan]]) -> None:
        parent, child = pairs[0]
        super().__init__(
            f"process {parent.vpid} ({parent.name}) is in vfork(): its child {child.vpid} "
            f"({child.name}) shares its memory and has not called exec or _exit",
            pid=child.hostpid, step="snapshot")
        self.pairs = pairs


class Exiting(Unsettled):
    """A process on its way out (killed just before the freeze, say): it would be gone before
    it could be seized, and its zombie, once there, is its parent's to carry. Its exit runs
    while the group is let run in short spells (template._plan_settled)."""

    wait_for = "fork once it has exited"

    def __init__(self, proc: ProcPlan) -> None:
        super().__init__(f"process {proc.vpid} ({proc.name}) is exiting", pid=proc.hostpid, step="snapshot")


_PF_EXITING = 0x00000004  # /proc/PID/stat's flags
_SIGKILL_BIT = 1 << (9 - 1)


_CLONE_CALLS = {"56", "58", "435"}  # clone, vfork, clone3 (x86_64)


def in_vfork(parent: ProcPlan) -> bool:
    """Whether a thread of ``parent`` is still inside the clone call that made a child sharing
    its memory: a vfork waits there for its child's exec or _exit, any other clone returns at
    once. /proc/PID/syscall names the call a blocked thread is in (unreadable: assumed so)."""
    for tid in parent.threads:
        try:
            with open(f"/proc/{parent.hostpid}/task/{tid}/syscall") as f:
                if f.read().split(" ", 1)[0] in _CLONE_CALLS:
                    return True
        except FileNotFoundError:  # an exited thread
            continue
        except OSError:
            return True
    return False


def vfork_pairs(procs: list[ProcPlan]) -> list[tuple[ProcPlan, ProcPlan]]:
    """(parent, child) of every process sharing its parent's address space while the parent
    is in vfork (see VforkInFlight). Only parents are compared: CLONE_VFORK with CLONE_PARENT
    would leave the sharer's own parent waiting, and glibc never asks for it."""
    from .._core._syscalls import KCMP_VM, kcmp

    by_vpid = {p.vpid: p for p in procs}
    pairs = []
    for p in procs:
        parent = by_vpid.get(p.ppid)
        if parent is None:
            continue
        try:
            if kcmp(parent.hostpid, p.hostpid, KCMP_VM, 0, 0) == 0 and in_vfork(parent):
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
    calls (Cloner.clone_enters_child) and the Cloner cannot transplant it
    (Cloner.cannot_enter). Where the kernel places them (the module's FORK) such a process is
    forked as any other."""
    from .cloners import cloner

    for p in procs:
        missing = [name for name, bit in CLONE_CAPS if not p.cap_eff >> bit & 1]
        if not missing:
            continue
        cl = cloner()
        if not cl.clone_enters_child:
            return
        why = cl.cannot_enter(p)
        if why is None:
            # transplanted: its clones run their fixups as root, their credentials set last
            p.transplanted = True
            continue
        raise ForkError(
            f"process {p.vpid} ({p.name}) runs as uid {inside(p.hostpid, 'uid', (p.uid,))[0]} "
            f"without {' and '.join(missing)}: "
            f"{why} (fork: {cl.name}), and a clone enters "
            "the child's namespaces and takes its pid there with system calls that need them "
            "(clone3 set_tid, setns), so this workspace cannot be forked here. The kernel module's "
            "FORK (bunshin.ko 0.5.0 or later, kmod/) places each clone in the child itself and "
            "forks such a process; without it, keep those capabilities in the workspace's programs "
            "(they run as root with them by default), or end that process before forking",
            pid=p.hostpid, step="snapshot")


_KCMP_VM, _KCMP_FILES, _KCMP_FS, _KCMP_SIGHAND, _KCMP_SYSVSEM = 1, 2, 3, 4, 6  # include/uapi/linux/kcmp.h


@dataclass(frozen=True)
class Sharing:
    """A kernel object two processes (not threads of one) share when one was made by clone()
    with ``flag`` and without CLONE_THREAD. A clone of a fork is made from inside its own
    process and gets an object of its own, and no system call makes a process take another's
    (unshare only splits one), so the sharing would be lost: refused, naming both."""

    kind: str
    flag: str
    kcmp_type: int
    lost: str  # what the two would no longer have in common in a child
    # equal for two processes sharing one object: only those are compared with kcmp; None for a
    # process that has none (the kernel makes some lazily, and kcmp finds two NULLs equal)
    key: Callable[[ProcPlan], Hashable]
    excused: Callable[[ProcPlan, ProcPlan], bool] | None = None  # a pair another check judges


_PF_KTHREAD = 0x00200000  # /proc/PID/stat's flags


@functools.cache
def without_undo_list() -> int:
    """A task kcmp can compare with that has no SEM_UNDO list: kthreadd (a kernel thread never
    makes one), else the trainer. Not a workspace's init: one CRIU restored has one."""
    try:
        with open("/proc/2/stat", "rb") as f:
            raw = f.read()
        if int(raw[raw.rindex(b")") + 2:].split()[6]) & _PF_KTHREAD:
            return 2
    except (OSError, ValueError, IndexError):
        pass
    return os.getpid()


def has_undo_list(tid: int) -> bool:
    """Whether task ``tid`` has a SEM_UNDO list: made at its first semop with SEM_UNDO, or
    when it was cloned with CLONE_SYSVSEM, and kept. kcmp finds two tasks without one equal."""
    from .._core._syscalls import kcmp

    return kcmp(without_undo_list(), tid, _KCMP_SYSVSEM, 0, 0) != 0


def _undo_list(p: ProcPlan) -> Hashable:
    try:
        return True if has_undo_list(p.hostpid) else None
    except OSError:  # no kcmp (CONFIG_KCMP off), or it is gone
        return None


# CLONE_IO is carried without its sharing. The I/O context holds the I/O priority and the block
# scheduler's bookkeeping: each clone gets the priority its process has (copy_io), so only a
# later ioprio_set on one no longer shows in the other's ioprio_get, a scheduling hint. And the
# kernel makes an I/O context lazily (ioprio_set, BFQ): CLONE_IO shares nothing when the parent
# had none yet, so no program can count on the sharing in the first place.
# A parent and its child sharing memory while the parent is in vfork are waited for
# (VforkInFlight); any other pair is refused after it by SHARED_MEMORY.
SHARINGS = (
    Sharing("descriptor table", "CLONE_FILES", _KCMP_FILES,
            "a descriptor one of them opens or closes would no longer be seen by the other",
            lambda p: tuple(f.fd for f in p.fds)),
    Sharing("file system context", "CLONE_FS", _KCMP_FS,
            "a chdir, chroot or umask of one would no longer move the other",
            lambda p: (p.cwd, p.umask)),
    # CLONE_SIGHAND needs CLONE_VM: never a vfork, refused before one is waited for
    Sharing("set of signal handlers", "CLONE_SIGHAND", _KCMP_SIGHAND,
            "a sigaction of one would no longer change the other's, nor a write to memory of one "
            "show in the other (CLONE_SIGHAND comes with CLONE_VM: one address space)",
            lambda p: p.handled),
    Sharing("SysV semaphore undo list", "CLONE_SYSVSEM", _KCMP_SYSVSEM,
            "a SEM_UNDO adjustment of one would be undone when it exits rather than when the "
            "last of them does (and the kernel shows no adjustments to copy)",
            _undo_list),
)

SHARED_MEMORY = Sharing("address space", "CLONE_VM", _KCMP_VM,
                        "a write to memory of one would no longer show in the other",
                        lambda p: p.vm_size or None,
                        excused=lambda a, b: (a.vpid == b.ppid and in_vfork(a)
                                              or b.vpid == a.ppid and in_vfork(b)))  # vfork_pairs'


def _sharing_runs(group: list[ProcPlan], kcmp_type: int) -> list[list[ProcPlan]]:
    """The processes of ``group`` that share one object of ``kcmp_type`` with another, by
    object: kcmp orders the objects, so sorted by it sharers are neighbours (CRIU's way)."""
    from .._core._syscalls import kcmp

    def cmp(a: ProcPlan, b: ProcPlan) -> int:
        return (0, -1, 1)[kcmp(a.hostpid, b.hostpid, kcmp_type, 0, 0)]

    try:
        ranked = sorted(group, key=functools.cmp_to_key(cmp))
        runs = [[ranked[0]]]
        for a, b in zip(ranked, ranked[1:]):
            if cmp(a, b) == 0:
                runs[-1].append(b)
            else:
                runs.append([b])
    except OSError:  # no kcmp (CONFIG_KCMP off), or one of them is gone
        return []
    return [run for run in runs if len(run) > 1]


def check_sharing(procs: list[ProcPlan], sharings=SHARINGS) -> None:
    """Refuse two processes that share a kernel object of ``sharings`` (see Sharing)."""
    for s in sharings:
        groups: dict[Hashable, list[ProcPlan]] = {}
        for p in procs:
            key = None if p.is_init else s.key(p)  # the init forks its processes: it shares none
            if key is not None:
                groups.setdefault(key, []).append(p)
        for group in groups.values():
            for run in _sharing_runs(group, s.kcmp_type) if len(group) > 1 else ():
                for a, b in itertools.combinations(sorted(run, key=lambda p: p.vpid), 2):
                    if s.excused is None or not s.excused(a, b):
                        raise ForkError(
                            f"processes {a.vpid} ({a.name}) and {b.vpid} ({b.name}) share one {s.kind} "
                            f"(clone with {s.flag}): each clone of a fork gets its own, as a clone is "
                            "made from inside its process and no system call joins another's, so "
                            f"{s.lost}; end one of them before forking", pid=b.hostpid, step="plan")


def plan_tree(hostpids: list[int]) -> list[ProcPlan]:
    """Plans for every process, init first; raises ForkError for what no handler supports
    (Unsettled for a vfork not over yet, a process exiting)."""
    from . import resources
    from .._core._syscalls import KCMP_FILE, kcmp

    statuses = {p: proc_status(p) for p in hostpids}
    procs = sorted((read_proc(p, statuses) for p in hostpids), key=lambda p: p.vpid)
    if not procs or not procs[0].is_init:
        raise ForkError("the workspace has no init process; it cannot be forked")
    exiting = next((p for p in procs if p.exiting), None)
    if exiting is not None:
        raise Exiting(exiting)
    check_sharing(procs)  # none of them is a vfork: refused before one is waited for
    pairs = vfork_pairs(procs)
    if pairs:
        raise VforkInFlight(pairs)
    check_sharing(procs, (SHARED_MEMORY,))
    check_caps(procs)
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
    _shared_across(procs)
    resources.check_tree(procs)
    resources.plan_procs(procs)
    for p in procs:
        p.reads.clear()
    return procs


def _shared_across(procs: list[ProcPlan]) -> None:
    """Set ``shared_from`` on each descriptor whose open file an earlier process holds too.
    Only descriptors alike in what fdinfo shows of the open file (inode, offset, status flags:
    O_CLOEXEC is the descriptor's own) can share one; kcmp confirms, the candidates sorted by
    it so that sharers are neighbours (as _sharing_runs). The init forks its processes: its own
    are not carried as such."""
    from .._core._syscalls import KCMP_FILE, kcmp

    alike: dict[tuple, list[tuple[ProcPlan, FdInfo]]] = {}
    for p in procs:
        if p.is_init:
            continue
        for f in p.fds:
            if f.dup_of is None:
                alike.setdefault((f.dev, f.ino, f.pos, f.flags & ~os.O_CLOEXEC), []).append((p, f))

    def cmp(a: tuple[ProcPlan, FdInfo], b: tuple[ProcPlan, FdInfo]) -> int:
        return (0, -1, 1)[kcmp(a[0].hostpid, b[0].hostpid, KCMP_FILE, a[1].fd, b[1].fd)]

    for group in alike.values():
        if len({p.vpid for p, _f in group}) < 2:
            continue
        try:
            ranked = sorted(group, key=functools.cmp_to_key(cmp))
            first = ranked[0]
            for prev, this in zip(ranked, ranked[1:]):
                if cmp(prev, this) != 0:
                    first = this
                elif this[0] is not first[0]:  # sorted stably: in plan order within one file
                    this[1].shared_from = (first[0].vpid, first[1].fd)
        except OSError:  # no kcmp (CONFIG_KCMP off), or one of them is gone
            pass


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
