"""A transplant: the clone of a process that cannot clone itself into a child (one running under
another uid: without CAP_SYS_ADMIN it may neither take a pid in the child's pid namespace nor
setns into its namespaces), made CRIU-restorer style on a stock kernel.

A clone's memory can only come from its creator, so the child's init (root, already in the
child's namespaces, root directory and cgroup) makes a blank copy of itself with the process's
pid, and the blank becomes the process: its own mappings go, the process's are made at the
same addresses (file mappings on the very files, handed over by the trainer), its private
pages are copied (only those present or swapped and not file-backed: untouched pages stay
untouched), then its mm bounds, auxv and executable (PR_SET_MM_MAP), registers and FPU state,
signal handlers and mask, robust list, rseq, alternate stack, limits, and descriptors (the
same open files, at the same numbers). The per-descriptor fixups then see what a fork's clone
would, and the credentials come last (:func:`set_credentials`, once the child is whole), so
that everything before runs as root: the fixups, its threads, its zombies. The process itself is only read.

While its old mappings go, the blank runs the injected calls from a region of ours
(:class:`_Region`: a syscall instruction, compel's batch program and its table, data and a
stack), placed where neither layout has anything, and unmapped at the end.

Its other threads are made by the fork's fixups as a clone's are (Tracee.clone_threads, as
root: each takes its tid), and the credentials are set in each. Seccomp filters are read by the
trainer (PTRACE_SECCOMP_GET_FILTER) and installed again while the blank is root. What is not
carried is refused at plan time (:func:`refusal`): mappings of kinds not handled here, seccomp
filters the fork's calls could not pass or that differ between its threads; and at the fork a
filter that hands calls to a listener.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import resource
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..compel import Tracee, suspends_seccomp
from ..errors import ForkError
from ..runtime.userns import inside
from .plan import ProcPlan, proc_status, read_text, seccomp_filters

log = logging.getLogger("bunshin.fork")
PAGE = mmap.PAGESIZE
_ALL = (1 << 64) - 1

# x86_64 system call numbers
_NR = {
    "mmap": 9, "mprotect": 10, "munmap": 11, "rt_sigaction": 13, "rt_sigprocmask": 14,
    "madvise": 28, "dup3": 292, "close": 3, "recvmsg": 47, "socketpair": 53, "fcntl": 72,
    "umask": 95, "sigaltstack": 131, "personality": 135, "prctl": 157, "mremap": 25,
    "set_tid_address": 218, "set_robust_list": 273, "rseq": 334, "close_range": 436,
    "brk": 12, "setgroups": 116, "setresuid": 117, "setresgid": 119, "setfsuid": 122,
    "setfsgid": 123, "capset": 126, "mseal": 462, "seccomp": 317,
}
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANON, _MAP_GROWSDOWN = 0x01, 0x02, 0x10, 0x20, 0x0100
_MAP_NORESERVE = 0x4000
_ROBUST_HEAD_SIZE = 24  # sizeof(struct robust_list_head): set_robust_list's only length
_MAP_FIXED_NOREPLACE = 0x100000
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_MADV_DONTNEED = 4
_PROT = {"r": 1, "w": 2, "x": 4}
_RWX = 7
_SS_ONSTACK, _SS_DISABLE = 1, 2
_RSEQ_UNREGISTER = 1
_MSG_CMSG_CLOEXEC = 0x40000000
_O_CLOEXEC = 0o2000000
_F_DUPFD_CLOEXEC, _F_GETFD = 1030, 1
(_PR_SET_PDEATHSIG, _PR_GET_DUMPABLE, _PR_SET_DUMPABLE, _PR_SET_NAME, _PR_CAPBSET_DROP,
 _PR_GET_SECUREBITS, _PR_SET_SECUREBITS, _PR_GET_TIMERSLACK, _PR_SET_TIMERSLACK, _PR_SET_MM,
 _PR_SET_NO_NEW_PRIVS, _PR_GET_TID_ADDRESS, _PR_CAP_AMBIENT) = (
    1, 3, 4, 15, 24, 27, 28, 30, 29, 35, 38, 40, 47)
_PR_SET_MM_MAP = 14
_NO_EXE = 0xFFFFFFFF  # PR_SET_MM_MAP's exe_fd: keep the executable
_PR_SET_THP_DISABLE, _PR_GET_THP_DISABLE = 41, 42
_PR_SET_MDWE, _PR_GET_MDWE = 65, 66
_PR_SET_MEMORY_MERGE, _PR_GET_MEMORY_MERGE = 67, 68
_PR_CAP_AMBIENT_RAISE, _PR_CAP_AMBIENT_CLEAR_ALL = 2, 4
_SECURE_NO_SETUID_FIXUP = 1 << 2
_CAP_VERSION_3 = 0x20080522
# VmFlags -> madvise advice
_MADV = {"rr": 1, "sr": 2, "dd": 16, "wf": 18, "hg": 14, "nh": 15, "mg": 12}
# the kernel's own mappings, moved rather than made: same kernel, same sizes
_SPECIAL = ("[vdso]", "[vvar]", "[vvar_vclock]")
_SIGNALS = [s for s in range(1, 65) if s not in (9, 19)]
_PM_PRESENT, _PM_SWAP, _PM_FILE, _PM_GUARD = 1 << 63, 1 << 62, 1 << 61, 1 << 58
_MADV_GUARD_INSTALL, _MADV_GUARD_REMOVE = 102, 103
_PFN_MASK = (1 << 55) - 1
_SYS_IOPRIO_SET, _SYS_IOPRIO_GET = 251, 252
_PR_SET_VMA, _PR_SET_VMA_ANON_NAME = 0x53564D41, 0
_SYS_PTRACE = 101
_PTRACE_SECCOMP_GET_FILTER, _PTRACE_SECCOMP_GET_METADATA = 0x420C, 0x420D
_BPF_RET_K, _BPF_RET_A = 0x06, 0x16
_SECCOMP_RET_USER_NOTIF = 0x7FC00000
_SECCOMP_SET_MODE_FILTER = 1
_COPY_CHUNK = 8 << 20
_FDS_PER_ROUND = 64


@dataclass
class Vma:
    start: int
    end: int
    perms: str
    offset: int
    dev: str
    ino: int
    path: str
    flags: set[str] = field(default_factory=set)  # VmFlags of smaps
    pkey: int = 0  # ProtectionKey of smaps

    @property
    def prot(self) -> int:
        return sum(_PROT[c] for c in self.perms[:3] if c in _PROT)

    @property
    def anon(self) -> bool:
        return self.ino == 0


_MAPS_LINE = re.compile(r"([0-9a-f]+)-([0-9a-f]+) (\S{4}) ([0-9a-f]+) (\S+) (\d+)\s*(.*)")


def read_vmas(pid: int, smaps: bool = True) -> list[Vma]:
    """The process's mappings (with their VmFlags from smaps)."""
    out: list[Vma] = []
    for line in read_text(f"/proc/{pid}/{'smaps' if smaps else 'maps'}").splitlines():
        m = _MAPS_LINE.fullmatch(line)
        if m:
            out.append(Vma(int(m[1], 16), int(m[2], 16), m[3], int(m[4], 16), m[5], int(m[6]),
                           m[7]))
        elif line.startswith("VmFlags:") and out:
            out[-1].flags = set(line.split()[1:])
        elif line.startswith("ProtectionKey:") and out:
            out[-1].pkey = int(line.split()[1])
    return out


# a thread's own credentials and filters (/proc/PID/task/TID/status): a transplant gives every
# thread its main thread's
_THREAD_OWN = ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb",
               "NoNewPrivs", "Seccomp_filters")
# mapping flags (smaps VmFlags) of state a mapping made again would not have
_NOT_MADE = {"ss": "a shadow stack", "um": "userfaultfd missing-page tracking",
             "uw": "userfaultfd write-protect tracking", "ui": "userfaultfd minor-fault tracking"}


def refusal(proc: ProcPlan) -> str | None:
    """Why ``proc`` cannot be transplanted (None: it can)."""
    if proc.seccomp_filters and suspends_seccomp() is False:
        return ("runs under seccomp filters, which this trainer's injected calls cannot pass "
                "(PTRACE_O_SUSPEND_SECCOMP needs CAP_SYS_ADMIN and an unfiltered trainer)")
    if len(proc.threads) > 1:
        differ = [k for k in _THREAD_OWN if len({proc_status(f"{proc.hostpid}/task/{tid}").get(k)
                                                 for tid in proc.threads}) > 1]
        if differ:
            return (f"has threads whose {', '.join(differ)} differ: a transplant's threads all "
                    "get its main thread's")
    for v in read_vmas(proc.hostpid):
        if v.path in ("[vsyscall]",) + _SPECIAL or "dc" in v.flags:
            continue
        kept = v.flags & _NOT_MADE.keys()
        if kept or v.pkey:
            what = (f"memory protection key {v.pkey}" if v.pkey
                    else ", ".join(_NOT_MADE[f] for f in sorted(kept)))
            return f"has a mapping at {v.start:#x}-{v.end:#x} with {what}, which a transplant does not make"
        if v.path.startswith("[") and v.path not in ("[heap]", "[stack]") and not _anon_name(v):
            return f"has a mapping of a kind a transplant does not make: {v.path}"
        if v.path.startswith("anon_inode:") or (v.path.startswith("/dev/") and not (
                v.path.startswith("/dev/shm/") or v.path == "/dev/zero (deleted)")):
            # opened again through /proc/PID/map_files it would be another open of the device
            # (or none at all), not the process's own mapping
            return (f"has a mapping of {v.path} at {v.start:#x}-{v.end:#x}, which a transplant "
                    "cannot map again")
    return None


class _Region:
    """Memory of ours in the blank, where neither its old layout nor the new one has anything:
    the syscall instruction the injected calls run, compel's batch program and table, the
    calls' data, and the stack compel's scratch goes below."""

    SIZE = 1 << 18
    CODE, TABLE, DATA = 0x100, 0x1000, 0x10000
    MAX_CALLS = (DATA - TABLE) // 64 - 2
    STACK = SIZE - 0x400

    def __init__(self, addr: int) -> None:
        self.addr = addr
        self._at = self.DATA

    def reset(self) -> None:
        self._at = self.DATA

    def put(self, t: Tracee, data: bytes) -> int:
        at = self.addr + self._at
        if self._at + len(data) > self.STACK - 0x1000:
            raise ForkError(f"pid {t.pid}: transplant data past its region", pid=t.pid,
                            step="transplant")
        t.write(at, data)
        self._at += (len(data) + 15) & ~15
        return at


def _free_range(size: int, *layouts: list[Vma]) -> int:
    """An address where ``size`` bytes overlap no mapping of any of ``layouts``."""
    taken = sorted((v.start, v.end) for vs in layouts for v in vs)
    at = 0x100000000000  # 16 TiB: between a PIE's text and the mmap area, in every layout
    while at + size < 0x7f0000000000:
        if all(e <= at or s >= at + size for s, e in taken):
            return at
        at += 1 << 32
    raise ForkError("no free range for a transplant's region", step="transplant")


@dataclass
class Source:
    """What a transplant takes of the process, read once per fork."""

    vmas: list[Vma]
    regs: dict
    xstate: bytes
    sigmask: int
    robust: tuple[int, int]
    rseq: tuple[int, int, int, int]
    altstack: tuple[int, int, int]
    clear_tid: int
    brk: int
    mm: tuple[int, ...]  # start_code .. env_end as PR_SET_MM_MAP takes them (but brk)
    auxv: bytes
    actions: dict[int, bytes]
    cloexec: dict[int, bool]
    status: dict[str, str]
    securebits: int
    dumpable: int
    timerslack: int
    personality: int
    comm: bytes
    rlimits: dict[int, tuple[int, int]]
    nice: int
    sched: tuple[int, int]
    filters: list[tuple[int, bytes]]  # seccomp (flags, program), oldest first
    thp_disable: int  # PR_GET_THP_DISABLE
    memory_merge: int  # PR_GET_MEMORY_MERGE (KSM for the whole process)
    mdwe: int  # PR_GET_MDWE (memory-deny-write-execute): set last, it forbids W+X mappings


def read_source(t: Tracee, proc: ProcPlan) -> Source:
    """Read what the transplant needs of the process behind ``t`` (seized, stopped): /proc, its
    registers, and what only it can tell (injected calls that change nothing)."""
    from ..compel import _reissued  # the call a new task makes again instead of restarting

    pid = t.pid
    st = _reissued(pid, t.thread_state())
    regs = dict(st.resume)
    calls: list[tuple[int, tuple[int, ...], int]] = [
        (_NR["brk"], (0,), 0), (_NR["prctl"], (_PR_GET_TID_ADDRESS, 0), 0),
        (_NR["prctl"], (_PR_GET_SECUREBITS,), 0), (_NR["prctl"], (_PR_GET_DUMPABLE,), 0),
        (_NR["prctl"], (_PR_GET_TIMERSLACK,), 0), (_NR["personality"], (0xFFFFFFFF,), 0)]
    # the process's memory flags (a kernel without one says EINVAL: then it has none)
    mm_flags: list[tuple[int, tuple[int, ...], int]] = [
        (_NR["prctl"], (get, 0, 0, 0, 0), Tracee.batch_ok_errno(22))
        for get in (_PR_GET_THP_DISABLE, _PR_GET_MEMORY_MERGE, _PR_GET_MDWE)]
    actions: dict[int, bytes] = {}
    with t.scratch() as data:  # room for 2048 bytes
        calls[1] = (_NR["prctl"], (_PR_GET_TID_ADDRESS, data), 0)
        got = t.calls(calls + mm_flags)
        if len(got) < len(calls + mm_flags) or any(-4096 < g < 0 for g in got[:len(calls)]):
            raise ForkError(f"process {proc.vpid} ({proc.name}): reading it for a transplant: "
                            f"{[c[0] for c in calls]} gave {got}", pid=pid, step="transplant")
        thp_disable, memory_merge, mdwe = (max(g, 0) for g in got[len(calls):])
        clear_tid = int.from_bytes(t.read(data, 8), "little")
        step = Tracee.max_calls()
        for at in range(0, len(_SIGNALS), step):
            sigs = _SIGNALS[at:at + step]
            t.calls([(_NR["rt_sigaction"], (s, 0, data + 32 * i, 8), 0)
                     for i, s in enumerate(sigs)])
            raw = t.read(data, 32 * len(sigs))
            for i, s in enumerate(sigs):
                actions[s] = raw[32 * i:32 * i + 32]
    fds = [f.fd for f in proc.fds]
    cloexec: dict[int, bool] = {}
    for at in range(0, len(fds), Tracee.max_calls()):
        part = fds[at:at + Tracee.max_calls()]
        flags = t.calls([(_NR["fcntl"], (fd, _F_GETFD), 0) for fd in part])
        cloexec.update({fd: bool(fl & 1) for fd, fl in zip(part, flags)})
    raw_stat = read_text(f"/proc/{pid}/stat")
    fields = raw_stat[raw_stat.rindex(")") + 2:].split()  # fields from 3 on
    f = lambda n: int(fields[n - 3])  # noqa: E731 (the field numbers of proc(5))
    mm = (f(26), f(27), f(45), f(46), f(47), f(28), f(48), f(49), f(50), f(51))
    with open(f"/proc/{pid}/auxv", "rb") as fh:
        auxv = fh.read()
    with open(f"/proc/{pid}/comm", "rb") as fh:
        comm = fh.read().rstrip(b"\n")
    rlimits = read_limits(pid)
    return Source(
        vmas=read_vmas(pid), regs=regs, xstate=t.xstate(), sigmask=st.sigmask,
        robust=st.robust_list, rseq=st.rseq, altstack=t.thread_altstack(), clear_tid=clear_tid,
        brk=got[0], mm=mm, auxv=auxv, actions=actions, cloexec=cloexec, status=proc_status(pid),
        securebits=got[2], dumpable=got[3], timerslack=got[4], personality=got[5], comm=comm,
        rlimits=rlimits, nice=f(19),
        sched=(os.sched_getscheduler(pid), os.sched_getparam(pid).sched_priority),
        filters=read_filters(pid, proc) if proc.seccomp_filters else [],
        thp_disable=thp_disable, memory_merge=memory_merge, mdwe=mdwe)


def read_filters(pid: int, proc: ProcPlan) -> list[tuple[int, bytes]]:
    """The process's seccomp filters with their flags, oldest first, asked of the kernel by its
    tracer (PTRACE_SECCOMP_GET_FILTER: this thread, which seized it). One that hands calls to a
    listener (SECCOMP_RET_USER_NOTIF) is refused: its listener cannot be had again."""
    return _filters(pid, proc.seccomp_filters, f"process {proc.vpid} ({proc.name})")


def _filters(pid: int, count: int, what: str) -> list[tuple[int, bytes]]:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long

    def ptrace(req: int, addr: int, data) -> int:
        got = libc.syscall(ctypes.c_long(_SYS_PTRACE), ctypes.c_long(req), ctypes.c_long(pid),
                           ctypes.c_long(addr), data)
        if got < 0:
            e = ctypes.get_errno()
            raise ForkError(f"{what}: reading its seccomp filter {addr}: {os.strerror(e)}",
                            pid=pid, step="seccomp", errno=e)
        return got

    out = []
    for i in range(count):  # 0: the oldest (the kernel counts from the first installed)
        n = ptrace(_PTRACE_SECCOMP_GET_FILTER, i, None)
        prog = ctypes.create_string_buffer(8 * n)
        ptrace(_PTRACE_SECCOMP_GET_FILTER, i, prog)
        meta = ctypes.create_string_buffer(struct.pack("QQ", i, 0))
        ptrace(_PTRACE_SECCOMP_GET_METADATA, 16, meta)
        code = prog.raw
        for at in range(0, len(code), 8):
            op, _jt, _jf, k = struct.unpack_from("HBBI", code, at)
            # a return of the accumulator may be any action, that one too
            if op == _BPF_RET_A or (op == _BPF_RET_K and k & 0xFFFF0000 == _SECCOMP_RET_USER_NOTIF):
                raise ForkError(f"{what}: its seccomp filter {i} hands calls to a listener "
                                "(SECCOMP_RET_USER_NOTIF)"
                                + (" or may (it returns a computed action)" if op == _BPF_RET_A else "")
                                + ", which a transplant cannot have again", pid=pid, step="seccomp")
        out.append((struct.unpack("QQ", meta.raw[:16])[1], code))
    return out


def read_limits(pid: int) -> dict[int, tuple[int, int]]:
    """The process's resource limits, from /proc (prlimit of another user's process needs
    CAP_SYS_RESOURCE), one line per limit in the kernel's order."""
    def value(word: str) -> int:
        return resource.RLIM_INFINITY if word == "unlimited" else int(word)

    out = {}
    for r, line in enumerate(read_text(f"/proc/{pid}/limits").splitlines()[1:]):
        soft, hard = line[26:].split()[:2]
        out[r] = (value(soft), value(hard))
    return out


class _Blank:
    """The blank being made into the process: its Tracee, our region in it, batches there."""

    def __init__(self, t: Tracee, what: str) -> None:
        self.t, self.what = t, what
        self.region: _Region | None = None

    def call(self, name: str, *args: int, ok: bool = False) -> int:
        got = self.t.syscall(_NR[name], *args)
        if got < 0 and got > -4096 and not ok:
            raise ForkError(f"{self.what}: transplant: {name} failed: {os.strerror(-got)}",
                            pid=self.t.pid, step="transplant", errno=-got)
        return got

    def batch(self, calls: Sequence[tuple[str, tuple[int, ...]]], ok: bool = False) -> list[int]:
        """``calls`` run in the region, in as few stops as it takes; any failure raises (but
        with ``ok``)."""
        reg = self.region
        assert reg is not None
        out: list[int] = []
        flag = Tracee.BATCH_OK_ERR if ok else 0
        for at in range(0, len(calls), reg.MAX_CALLS):
            part = calls[at:at + reg.MAX_CALLS]
            got = self.t.batch(reg.addr + reg.CODE, reg.addr + reg.TABLE,
                               [(_NR[n], a, flag) for n, a in part])
            if len(got) < len(part) or (not ok and got and -4096 < got[-1] < 0):
                name, args = part[len(got) - 1]
                err = -got[-1]
                raise ForkError(f"{self.what}: transplant: {name}{tuple(hex(a) for a in args)} "
                                f"failed: {os.strerror(err)}", pid=self.t.pid, step="transplant",
                                errno=err)
            out += got
        return out


def make(donor: Tracee, src: Tracee, s: Source, proc: ProcPlan) -> Tracee:
    """The transplant of ``proc`` (seized as ``src``, read as ``s``) made by ``donor``, the
    child's init: returned stopped and traced, as a clone would be, but with its template's
    credentials still to set (:func:`set_credentials`, once the child is whole). On failure no blank
    is left."""
    what = f"process {proc.vpid} ({proc.name})"
    try:
        blank = donor.clone(set_tid=proc.vpid)
    except ForkError as e:
        raise ForkError(f"{what}: its transplant's blank could not be made in the child: "
                        f"{os.strerror(e.errno) if e.errno else e} (step {e.step!r})",
                        pid=e.pid, step=e.step, errno=e.errno) from None
    try:
        _become(_Blank(blank, what), src, s)
    except BaseException:
        from .engine import discard_clone

        discard_clone(blank)
        raise
    return blank


def make_by_init(init_pid: int, src: Tracee, s: Source, proc: ProcPlan) -> Tracee:
    """:func:`make` with the child's init ``init_pid`` as the donor, seized for it and let go.
    The init is seized with the source's bound: the blank and every call in it inherit it."""
    donor = Tracee.seize(init_pid, src.wait_timeout)
    blank = None
    try:
        blank = make(donor, src, s, proc)
    finally:
        try:
            donor.detach()
        except BaseException:
            if blank is not None:  # the fork fails: a traced blank would keep the child's pidns
                from .engine import discard_clone

                discard_clone(blank)
            raise
    return blank


def become(t: Tracee, src: Tracee, s: Source, proc: ProcPlan) -> None:
    """``t``, a clone in the child holding another process's memory (tree.py: the clone of a
    parent, made with its child's memory so that it could make that child's clone), made into
    ``proc`` (seized as ``src``, read as ``s``) as :func:`make` makes a blank: its children
    stay. Its credentials are still to set (:func:`set_credentials`)."""
    what = f"process {proc.vpid} ({proc.name})"
    got = list(t.calls([(_NR["prctl"], (get, 0, 0, 0, 0), Tracee.batch_ok_errno(22))
                        for get in (_PR_GET_MEMORY_MERGE, _PR_GET_MDWE)]))
    merge, mdwe = (max(g, 0) for g in (got + [0, 0])[:2])
    if mdwe and mdwe != s.mdwe:  # set for good in the process t was made of
        raise ForkError(f"{what}: its clone, made of its child, has that child's "
                        "memory-deny-write-execute (PR_SET_MDWE), which cannot be taken back",
                        pid=src.pid, step="transplant")
    if merge and not s.memory_merge:
        t.syscall(_NR["prctl"], _PR_SET_MEMORY_MERGE, 0, 0, 0, 0)
    _become(_Blank(t, what), src, s)


def _become(b: _Blank, src: Tracee, s: Source) -> None:
    t = b.t
    own = read_vmas(t.pid)
    alike = _alike(own, s.vmas)
    specials = {v.path: v for v in own if v.path in _SPECIAL}
    moved = sum(v.end - v.start for v in specials.values())
    addr = _free_range(_Region.SIZE + moved, own, s.vmas)
    reg = _Region(addr)
    # our region first, while the blank's own code still runs the calls
    b.call("mmap", addr, reg.SIZE, _RWX, _MAP_PRIVATE | _MAP_ANON | _MAP_FIXED_NOREPLACE, -1, 0)
    t.write(addr, b"\x0f\x05")  # syscall
    mine = t.thread_state()
    if mine.rseq[0]:  # the kernel writes to a registered rseq area: it must not outlive it
        b.call("rseq", mine.rseq[0], mine.rseq[1], _RSEQ_UNREGISTER, mine.rseq[2])
    # from here on the calls run from the region: stopped as if in a call made there
    t.replace(dict(mine.regs, rip=addr + 2, orig_rax=39, rax=0, rsp=addr + reg.STACK))
    b.region = reg
    b.batch([("munmap", (v.start, v.end - v.start)) for v in own
             if v.path not in _SPECIAL and v.path != "[vsyscall]" and v.start != addr
             and (v.start, v.end) not in alike])
    # the kernel's mappings to the process's addresses, through a spare place of the region's
    # (a move onto another's place would unmap it)
    spare = addr + reg.SIZE
    moves = []
    for name, v in specials.items():
        moves.append(("mremap", (v.start, v.end - v.start, v.end - v.start,
                                 _MREMAP_MAYMOVE | _MREMAP_FIXED, spare)))
        specials[name] = Vma(spare, spare + v.end - v.start, v.perms, 0, "", 0, name)
        spare += v.end - v.start
    want = {v.path: v for v in s.vmas if v.path in _SPECIAL}
    for name, v in specials.items():
        w = want.get(name)
        if w is None or w.end - w.start != v.end - v.start:
            raise ForkError(f"{b.what}: its {name} is not the kernel's own size here",
                            pid=src.pid, step="transplant")
        moves.append(("mremap", (v.start, v.end - v.start, v.end - v.start,
                                 _MREMAP_MAYMOVE | _MREMAP_FIXED, w.start)))
    b.batch(moves)
    _map(b, src, s, alike)
    start = time.perf_counter()
    copied, stale, guards = _copy_pages(src.pid, t.pid, s.vmas, alike)
    b.batch([("madvise", (at, end - at, _MADV_DONTNEED)) for at, end in stale]
            + [("madvise", (at, end - at, advice)) for at, end, advice in guards])
    log.debug("%s: transplant copied %.1f MiB in %.1f ms", b.what, copied / (1 << 20),
              (time.perf_counter() - start) * 1e3)
    _task_state(b, src, s)
    _descriptors(b, src, s)
    # the process's own registers: compel looks for a syscall instruction again, in the
    # process's code now, so that our region can go, last
    t.replace(s.regs, s.xstate)
    b.region = None
    b.call("munmap", addr, reg.SIZE)


def _kept(v: Vma) -> bool:
    """Whether the blank gets this mapping: a fork's child has it (MADV_DONTFORK's do not go),
    and it is not a SysV segment (its clone attaches the child's copy at the same address,
    resources/sysv_shm.py, as a clone's does)."""
    return (v.path not in _SPECIAL and v.path != "[vsyscall]" and "dc" not in v.flags
            and not _sysv(v))


def _sysv(v: Vma) -> bool:
    """Whether it is a SysV segment's attachment."""
    return v.perms[3] == "s" and v.path.startswith("/SYSV")


def _anon_name(v: Vma) -> str | None:
    """The name PR_SET_VMA_ANON_NAME gave a private anonymous mapping, if any."""
    if v.ino == 0 and v.path.startswith("[anon:") and v.path.endswith("]"):
        return v.path[6:-1]
    return None


def _file_key(v: Vma) -> tuple[str, int, str, bool]:
    """A mapped file, and whether it must be opened for writing (a writable shared mapping).
    With its path: the device and inode maps (and stat) show are the file system's and the
    overlay's, and two btrfs subvolumes (a layer and its snapshot) number their inodes alike."""
    return v.dev, v.ino, v.path, v.perms[3] == "s" and "w" in v.perms


def _map(b: _Blank, src: Tracee, s: Source, alike: set[tuple[int, int]]) -> None:
    """The process's mappings at their addresses (but those the blank has ``alike``): each
    file's through a descriptor of the trainer's (/proc/PID/map_files) handed over."""
    files: dict[tuple[str, int, str, bool], int] = {}
    try:
        for v in s.vmas:
            key = _file_key(v)
            if _kept(v) and (v.start, v.end) not in alike and not v.anon and key not in files:
                files[key] = os.open(f"/proc/{src.pid}/map_files/{v.start:x}-{v.end:x}",
                                     (os.O_RDWR if key[3] else os.O_RDONLY) | os.O_CLOEXEC)
        order = list(files)
        there = dict(zip(order, _hand_over(b, [files[k] for k in order])))
    finally:
        for fd in files.values():
            os.close(fd)
    calls: list[tuple[str, tuple[int, ...]]] = []
    for v in s.vmas:
        if _sysv(v):  # held for its attachment (shmat SHM_REMAP replaces it): compel's
            # scratch, mapped where the process has nothing, must not land there first
            calls.append(("mmap", (v.start, v.end - v.start, 0, _MAP_PRIVATE | _MAP_ANON | _MAP_FIXED,
                                   _ALL, 0)))
        if not _kept(v) or (v.start, v.end) in alike:
            continue
        flags = ((_MAP_SHARED if v.perms[3] == "s" else _MAP_PRIVATE) | _MAP_FIXED
                 | (_MAP_NORESERVE if "nr" in v.flags else 0))
        if v.anon:
            flags |= _MAP_ANON | (_MAP_GROWSDOWN if "gd" in v.flags else 0)
            calls.append(("mmap", (v.start, v.end - v.start, v.prot, flags, _ALL, 0)))
        else:  # a MAP_SHARED one on the process's own object, as fork leaves it: the shared
            # memory fixups (resources/shmem.py) give the child its copy
            calls.append(("mmap", (v.start, v.end - v.start, v.prot, flags,
                                   there[_file_key(v)], v.offset)))
        name = _anon_name(v)
        if name is not None and b.region is not None:
            calls.append(("prctl", (_PR_SET_VMA, _PR_SET_VMA_ANON_NAME, v.start, v.end - v.start,
                                    b.region.put(b.t, os.fsencode(name) + b"\0"))))
        for flag, advice in _MADV.items():
            if flag in v.flags:
                calls.append(("madvise", (v.start, v.end - v.start, advice)))
    calls += [("close", (fd,)) for fd in there.values()]
    # sealed last: a sealed mapping can no longer be changed
    calls += [("mseal", (v.start, v.end - v.start, 0)) for v in s.vmas if _kept(v) and "sl" in v.flags]
    b.batch(calls)


_PM_WINDOW = 1 << 20  # page map entries read at once (8 MiB)


def _copy_pages(frm: int, to: int, vmas: list[Vma],
                alike: set[tuple[int, int]]) -> tuple[int, list[tuple[int, int]], list[tuple[int, int, int]]]:
    """The process's private pages (present or swapped, not the file's own) written into the
    blank; returns bytes copied, the ranges of the blank's own pages to drop (MADV_DONTNEED)
    in its mappings ``alike``, and (start, end, advice) of the guard regions to install in
    it or, in ``alike``, to remove from it. In ``alike`` a page the blank shares with the
    process (the same frame, copy-on-write) is kept rather than copied. process_vm_readv/writev copy once; a mapping
    they may not touch (not readable, or not writable in the blank) goes through
    /proc/PID/mem, which writes read-only mappings too (FOLL_FORCE) but one page at a time,
    through a bounce page."""
    import ctypes

    import numpy as np

    from ..memory.pagemap import zero_pfns

    zero, huge_lo, huge_hi = zero_pfns()
    copied = 0
    stale: list[tuple[int, int]] = []
    guards: list[tuple[int, int, int]] = []
    fds: list[int] = []
    try:
        for path, mode in ((f"/proc/{frm}/pagemap", os.O_RDONLY), (f"/proc/{to}/pagemap", os.O_RDONLY),
                           (f"/proc/{frm}/mem", os.O_RDONLY), (f"/proc/{to}/mem", os.O_WRONLY)):
            fds.append(os.open(path, mode | os.O_CLOEXEC))
        pm, own, src, dst = fds
        buf = (ctypes.c_char * _COPY_CHUNK)()
        view = memoryview(buf).cast("B")
        for v, start, n in _windows(vmas):
            raw = os.pread(pm, n * 8, start // PAGE * 8)
            ent = np.frombuffer(raw, dtype=np.uint64)
            # a guard region (MADV_GUARD_INSTALL) is a marker, not a page: made again, not copied
            guard = (ent & np.uint64(_PM_GUARD)) != 0
            want = ((ent & np.uint64(_PM_PRESENT | _PM_SWAP)) != 0) & ((ent & np.uint64(_PM_FILE)) == 0) & ~guard
            # a page only read maps the zero page: it stays untouched in the blank too
            pfn = np.where((ent & np.uint64(_PM_PRESENT)) != 0, ent & np.uint64(_PFN_MASK), 0)
            want &= (pfn != zero) & ((pfn < huge_lo) | (pfn >= huge_hi))
            if (v.start, v.end) in alike:
                mine = np.frombuffer(os.pread(own, n * 8, start // PAGE * 8), dtype=np.uint64)
                present = (ent & np.uint64(_PM_PRESENT)) != 0
                same = present & ((mine & np.uint64(_PM_PRESENT)) != 0) & (
                    (mine & np.uint64(_PFN_MASK)) == pfn)
                want &= ~same
                mine_guard = (mine & np.uint64(_PM_GUARD)) != 0
                has = ((mine & np.uint64(_PM_PRESENT | _PM_SWAP)) != 0) & (
                    (mine & np.uint64(_PM_FILE)) == 0) & ~mine_guard
                stale += _ranges(start, has & ~want & ~same)
                guards += [(a, e, _MADV_GUARD_REMOVE) for a, e in _ranges(start, mine_guard & ~guard)]
                guard &= ~mine_guard
            guards += [(a, e, _MADV_GUARD_INSTALL) for a, e in _ranges(start, guard)]
            if not want.any():
                continue
            edges = np.flatnonzero(np.diff(np.concatenate(([0], want.astype(np.int8), [0]))))
            for first, last in zip(edges[::2], edges[1::2]):
                at, end = start + int(first) * PAGE, start + int(last) * PAGE
                while at < end:
                    size = min(end - at, _COPY_CHUNK)
                    if "r" in v.perms:
                        got = _vm_rw(_process_vm_readv, frm, buf, at, size)
                    else:
                        got = os.preadv(src, [view[:size]], at)
                    if got == size and "w" in v.perms:
                        put = _vm_rw(_process_vm_writev, to, buf, at, size)
                    elif got == size:
                        put = os.pwrite(dst, view[:size], at)
                    if got != size or put != size:
                        raise ForkError(f"pid {frm}: copying its memory at {at:#x} into {to}: "
                                        "short", pid=frm, step="transplant")
                    copied += size
                    at += size
    finally:
        for fd in fds:
            os.close(fd)
    return copied, stale, guards


def _windows(vmas: list[Vma]):
    """(mapping, start, pages) of each copied mapping, in windows of at most _PM_WINDOW pages:
    a huge reservation (a sanitizer's shadow) is read a window of its page map at a time."""
    for v in vmas:
        if not _kept(v) or "wf" in v.flags:
            continue
        for start in range(v.start, v.end, _PM_WINDOW * PAGE):
            yield v, start, min(_PM_WINDOW, (v.end - start) // PAGE)


def _ranges(start: int, pages) -> list[tuple[int, int]]:
    """The address ranges of the runs of True in ``pages`` (a numpy bool array, one a page
    from ``start``)."""
    import numpy as np

    edges = np.flatnonzero(np.diff(np.concatenate(([0], pages.astype(np.int8), [0]))))
    return [(start + int(a) * PAGE, start + int(e) * PAGE) for a, e in zip(edges[::2], edges[1::2])]


def _alike(own: list[Vma], theirs: list[Vma]) -> set[tuple[int, int]]:
    """The private mappings the blank has as the process has them (same range, protection,
    object and flags): a parent's clone made with its child's memory keeps them, and with
    them the pages both still share copy-on-write (tree.py)."""
    mine = {(v.start, v.end): v for v in own}
    out = set()
    for v in theirs:
        w = mine.get((v.start, v.end))
        if (w is not None and _kept(v) and v.perms[3] == "p" and not {"wf", "lo"} & v.flags
                and (w.perms, w.offset, w.dev, w.ino, w.path, w.flags)
                == (v.perms, v.offset, v.dev, v.ino, v.path, v.flags)):
            out.add((v.start, v.end))
    return out


def _vm_call(name: str):
    import ctypes

    fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                   ctypes.c_ulong]
    return fn


_process_vm_readv = _vm_call("process_vm_readv")
_process_vm_writev = _vm_call("process_vm_writev")


def _vm_rw(fn, pid: int, buf, at: int, size: int) -> int:
    """``size`` bytes between our ``buf`` and ``pid``'s memory at ``at``; bytes moved, or -1."""
    import ctypes

    local = struct.pack("QQ", ctypes.addressof(buf), size)
    remote = struct.pack("QQ", at, size)
    return fn(pid, local, 1, remote, 1, 0)


def _task_state(b: _Blank, src: Tracee, s: Source) -> None:
    """What fork() would have copied of the task and the blank has of the init: mm bounds and
    executable, signal handlers and mask, the thread's registrations, limits and the rest."""
    reg = b.region
    assert reg is not None
    reg.reset()
    t = b.t
    with open(f"/proc/{src.pid}/exe", "rb") as fh:  # its executable, for PR_SET_MM_MAP
        mine = os.stat(f"/proc/{t.pid}/exe")
        theirs = os.fstat(fh.fileno())
        # the blank's already (a parent's clone made from a child that did not exec): kept, as
        # Linux before 6.? refuses a new one while the old is mapped (EBUSY), even the same file
        same = (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)
        (exe,) = (_NO_EXE,) if same else _hand_over(b, [fh.fileno()])
    for r, lim in s.rlimits.items():  # before the bounds: RLIMIT_DATA judges them
        try:
            resource.prlimit(t.pid, r, lim)
        except OSError as e:
            raise ForkError(f"{b.what}: transplant: its limit {r} {lim} cannot be set on a copy "
                            f"of the child's init: {e.strerror}", pid=t.pid, step="transplant",
                            errno=e.errno) from None
    auxv = reg.put(t, s.auxv)
    code, end_code, data, end_data, start_brk, stack, arg, end_arg, env, end_env = s.mm
    mm = reg.put(t, struct.pack("11QQII", code, end_code, data, end_data, start_brk, s.brk, stack,
                                arg, end_arg, env, end_env, auxv, len(s.auxv), exe))
    calls: list[tuple[str, tuple[int, ...]]] = [("prctl", (_PR_SET_MM, _PR_SET_MM_MAP, mm, 104, 0))]
    if exe != _NO_EXE:
        calls.append(("close", (exe,)))
    for sig, act in s.actions.items():
        calls.append(("rt_sigaction", (sig, reg.put(t, act), 0, 8)))
    calls.append(("rt_sigprocmask", (2, reg.put(t, struct.pack("Q", s.sigmask)), 0, 8)))
    sp, flags, size = s.altstack
    if flags & _SS_DISABLE:
        sp = size = 0
    alt = struct.pack("Qi4xQ", sp, flags & ~_SS_ONSTACK, size)
    calls.append(("sigaltstack", (reg.put(t, alt), 0)))
    calls.append(("set_tid_address", (s.clear_tid,)))
    # also none: a blank made of another process (tree.py) holds that one's
    calls.append(("set_robust_list", s.robust if s.robust[0] else (0, _ROBUST_HEAD_SIZE)))
    if s.rseq[0]:
        calls.append(("rseq", (s.rseq[0], s.rseq[1], 0, s.rseq[2])))
    calls.append(("umask", (int(s.status["Umask"], 8),)))
    calls.append(("personality", (s.personality,)))
    calls.append(("prctl", (_PR_SET_NAME, reg.put(t, s.comm[:15] + b"\0"))))
    calls.append(("prctl", (_PR_SET_TIMERSLACK, s.timerslack)))
    if s.status.get("NoNewPrivs", "0").strip() == "1":
        calls.append(("prctl", (_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)))
    # off too: a blank made of another process (become) has that one's
    calls.append(("prctl", (_PR_SET_THP_DISABLE, s.thp_disable, 0, 0, 0)))
    if s.memory_merge:
        calls.append(("prctl", (_PR_SET_MEMORY_MERGE, s.memory_merge, 0, 0, 0)))
    # as root (no need of no_new_privs), before its threads are made (they get them): the
    # fork's own calls pass them (PTRACE_O_SUSPEND_SECCOMP)
    for how, program in _new_filters(b, s):
        at = reg.put(t, program)
        calls.append(("seccomp", (_SECCOMP_SET_MODE_FILTER, how,
                                  reg.put(t, struct.pack("H6xQ", len(program) // 8, at)))))
    b.batch(calls)
    os.setpriority(os.PRIO_PROCESS, t.pid, s.nice)
    policy, prio = s.sched
    os.sched_setscheduler(t.pid, policy, os.sched_param(prio))
    _ioprio(src.pid, t.pid)
    for name in ("oom_score_adj", "coredump_filter"):  # what fork copies and /proc shows
        want = read_text(f"/proc/{src.pid}/{name}")
        if read_text(f"/proc/{t.pid}/{name}") != want:
            try:
                with open(f"/proc/{t.pid}/{name}", "w") as fh:
                    fh.write(want)
            except OSError as e:
                raise ForkError(f"{b.what}: transplant: its {name} {want.strip()} cannot be set: "
                                f"{e.strerror}", pid=t.pid, step="transplant",
                                errno=e.errno) from None


def _new_filters(b: _Blank, s: Source) -> list[tuple[int, bytes]]:
    """The process's seccomp filters the blank lacks. A blank made from the child's init, or
    from a parent's clone, holds the filters every process inherits from the workspace's init
    (a sandbox's, bunshin.sandbox): the process's oldest ones, not to be stacked twice."""
    have = seccomp_filters(proc_status(b.t.pid))
    if not have:
        return s.filters
    mine = [code for _, code in _filters(b.t.pid, have, b.what + "'s blank")]
    if mine != [code for _, code in s.filters[:have]]:
        raise ForkError(f"{b.what}: transplant: its seccomp filters do not begin with the "
                        f"{have} its blank inherited", pid=b.t.pid, step="seccomp")
    return s.filters[have:]


def _ioprio(frm: int, to: int) -> None:
    """The I/O priority (fork copies it), asked and set by the trainer."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    who_process = 1
    prio = libc.syscall(ctypes.c_long(_SYS_IOPRIO_GET), ctypes.c_long(who_process), ctypes.c_long(frm))
    if prio < 0 or libc.syscall(ctypes.c_long(_SYS_IOPRIO_SET), ctypes.c_long(who_process),
                                ctypes.c_long(to), ctypes.c_long(prio)) < 0:
        e = ctypes.get_errno()
        raise ForkError(f"pid {frm}: transplant: its I/O priority: {os.strerror(e)}", pid=frm,
                        step="transplant", errno=e)


def _hand_over(b: _Blank, fds: list[int]) -> list[int]:
    """The trainer's descriptors ``fds`` installed in the blank (close-on-exec); their numbers
    there, each the lowest one free as it came."""
    reg = b.region
    assert reg is not None
    t = b.t
    out: list[int] = []
    reg.reset()
    pair = reg.put(t, bytes(8))
    b.call("socketpair", socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC, 0, pair)
    theirs, ours = struct.unpack("ii", t.read(pair, 8))
    space = socket.CMSG_SPACE(4)
    byte = reg.put(t, bytes(8))
    iov = reg.put(t, struct.pack("QQ", byte, 1))
    cmsg = reg.put(t, bytes(space))
    msg = reg.put(t, struct.pack("QI4xQQQQi4x", 0, 0, iov, 1, cmsg, space, 0))
    from .resources.sharing import getfd_here

    try:
        with socket.socket(fileno=getfd_here(t.pid, ours)) as sock:
            for at in range(0, len(fds), _FDS_PER_ROUND):
                part = fds[at:at + _FDS_PER_ROUND]
                before = set(os.listdir(f"/proc/{t.pid}/fd"))
                for fd in part:
                    socket.send_fds(sock, [b"\0"], [fd])
                got = b.batch([("recvmsg", (theirs, msg, _MSG_CMSG_CLOEXEC))] * len(part))
                new = sorted(int(x) for x in set(os.listdir(f"/proc/{t.pid}/fd")) - before)
                if any(g != 1 for g in got) or len(new) != len(part):
                    raise ForkError(f"{b.what}: transplant: a descriptor handed over did not come",
                                    pid=t.pid, step="recvmsg")
                out += new  # each at the lowest number free as it came: in the order sent
    finally:
        b.call("close", theirs, ok=True)
        b.call("close", ours, ok=True)
    return out


def _descriptors(b: _Blank, src: Tracee, s: Source) -> None:
    """The process's open files at their numbers, with their FD_CLOEXEC: the blank's own (the
    init's) closed first. They come in at the lowest numbers free, go above the highest the
    process has, then to their own."""
    from .resources.sharing import getfd_here

    b.call("close_range", 0, 0xFFFFFFFF, 0)
    wanted = sorted(s.cloexec)
    if not wanted:
        return
    above = wanted[-1] + 1
    room = above + 2 * len(wanted) + 8
    soft, hard = s.rlimits[resource.RLIMIT_NOFILE]
    if soft < room:  # room for the moves, its own limit put back after
        resource.prlimit(b.t.pid, resource.RLIMIT_NOFILE, (min(room, hard), hard))
    mine = []
    try:
        for fd in wanted:
            mine.append(getfd_here(src.pid, fd))
        there = _hand_over(b, mine)
    finally:
        for fd in mine:
            os.close(fd)
    high = b.batch([("fcntl", (h, _F_DUPFD_CLOEXEC, above)) for h in there])
    b.batch([("close", (h,)) for h in there]
            + [("dup3", (h, fd, _O_CLOEXEC if s.cloexec[fd] else 0)) for h, fd in zip(high, wanted)]
            + [("close", (h,)) for h in high])
    if soft < room:
        resource.prlimit(b.t.pid, resource.RLIMIT_NOFILE, (soft, hard))


def _caps(status: dict[str, str], key: str) -> int:
    return int(status[key], 16)


def set_credentials(t: Tracee, what: str, s: Source, pdeath_signal: int | None) -> None:
    """The process's credentials on its transplant, after every fixup that needs root: groups,
    gids, uids, bounding set, ambient set, securebits and capabilities (CRIU's order: uid
    changes keep the capabilities, SECURE_NO_SETUID_FIXUP, until they are set themselves),
    then what a change of credentials resets (dumpable, the parent-death signal)."""
    st = s.status
    # /proc shows the trainer's view of them; the process sets them in its user namespace
    uids = inside(t.pid, "uid", (int(x) for x in st["Uid"].split()))
    gids = inside(t.pid, "gid", (int(x) for x in st["Gid"].split()))
    groups = inside(t.pid, "gid", (int(x) for x in st.get("Groups", "").split()))

    tids = t.threads()

    def call(nr: str, *args: int, everywhere: bool = True) -> None:
        """In every thread: credentials are a thread's own (its threads are made as root)."""
        for tid in tids if everywhere else tids[:1]:
            got = (t.syscall(_NR[nr], *args) if tid == t.pid
                   else t.thread_syscall(tid, _NR[nr], *args[:4]))  # (the rest are 0)
            if -4096 < got < 0:
                raise ForkError(f"{what}: transplant: {nr}{args} in thread {tid}: "
                                f"{os.strerror(-got)}", pid=t.pid, step="credentials", errno=-got)

    with t.scratch() as data:
        call("prctl", _PR_SET_SECUREBITS, _SECURE_NO_SETUID_FIXUP)
        if groups:
            t.write(data, struct.pack(f"{len(groups)}I", *groups))
        call("setgroups", len(groups), data)
        call("setresgid", *gids[:3])
        call("setfsgid", gids[3])
        call("setresuid", *uids[:3])
        call("setfsuid", uids[3])
        bnd = _caps(st, "CapBnd")
        last = int(read_text("/proc/sys/kernel/cap_last_cap"))
        for cap in range(last + 1):
            if not bnd >> cap & 1:
                call("prctl", _PR_CAPBSET_DROP, cap)
        call("prctl", _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        amb = _caps(st, "CapAmb")
        inh = _caps(st, "CapInh")
        if amb:  # raised only from the inheritable set: the blank's (root's) may lack them
            now = proc_status(t.pid)
            _capset(t, data, _caps(now, "CapEff"), _caps(now, "CapPrm"), inh | amb, call)
        for cap in range(last + 1):
            if amb >> cap & 1:
                call("prctl", _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE, cap, 0, 0)
        call("prctl", _PR_SET_SECUREBITS, s.securebits)
        _capset(t, data, _caps(st, "CapEff"), _caps(st, "CapPrm"), inh, call)
    if s.dumpable in (0, 1):  # 2 (suid_dumpable) is what the uid change above gave it
        call("prctl", _PR_SET_DUMPABLE, s.dumpable, everywhere=False)  # the process's
    if pdeath_signal:
        call("prctl", _PR_SET_PDEATHSIG, pdeath_signal, everywhere=False)
    if s.mdwe:  # last: from here no writable+executable memory can be mapped in it
        call("prctl", _PR_SET_MDWE, s.mdwe, 0, 0, 0, everywhere=False)


def _capset(t: Tracee, data: int, eff: int, prm: int, inh: int, call) -> None:
    t.write(data, struct.pack("II", _CAP_VERSION_3, 0)
            + struct.pack("6I", eff & 0xFFFFFFFF, prm & 0xFFFFFFFF, inh & 0xFFFFFFFF,
                          eff >> 32, prm >> 32, inh >> 32))
    call("capset", data, data + 8)
