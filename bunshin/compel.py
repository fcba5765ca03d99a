"""Syscall injection into live processes: the base the fork engine stands on.

A :class:`Tracee` is one process seized with ptrace. Everything it does happens inside the
victim, which is stopped meanwhile and afterwards continues as if nothing had happened:
registers, patched bytes and interrupted system calls are restored (*cured*), and signals
that arrived meanwhile are queued again with their original sender information.

>>> with Tracee.seize(pid) as t:           # doctest: +SKIP
...     t.stop_all()
...     t.syscall(SYS_getpid) == pid
True

All calls on one Tracee must come from the thread that seized it (ptrace attaches to a
thread). Failures raise :class:`bunshin.errors.ForkError` with ``.pid``, ``.step`` and
``.errno`` set; the victim is left running and intact whenever it still exists.
"""

from __future__ import annotations

import contextlib
import errno
import mmap as _mmap
import os
import signal
import socket
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

from .errors import ForkError

R = TypeVar("R")

__all__ = ["Tracee", "ThreadState", "SYS_getpid", "SYS_exit_group"]

SYS_getpid = 39
SYS_exit_group = 231
_SYS_set_tid_address = 218
_SYS_recvmsg = 47
MSG_CMSG_CLOEXEC = 0x40000000  # the received descriptors are close-on-exec

# x86_64: the kernel's code for "the call's remaining work is in current->restart_block"
# (include/linux/errno.h), and the calls whose time left user space can see
_ERESTART_RESTARTBLOCK = 516
_SYS_nanosleep, _SYS_clock_nanosleep, _SYS_restart_syscall = 35, 230, 219
_SYSCALL_INSN_LEN = 2
_WORD = (1 << 64) - 1

_core: Any = None


def _compel() -> Any:
    global _core
    if _core is None:
        from ._core import _compel as mod

        _core = mod
    return _core


def suspends_seccomp() -> bool | None:
    """Whether this trainer's seizes suspend the victims' seccomp filters (None: no seize made
    yet). They do with CAP_SYS_ADMIN, when the trainer is not filtered itself."""
    v = int(_compel().suspends_seccomp())
    return None if v < 0 else bool(v)


def _translate(exc: OSError, pid: int, bound: float = 0.0) -> ForkError:
    step = getattr(exc, "step", "seize")
    pid = getattr(exc, "pid", pid)
    tid: int = getattr(exc, "tid", 0)
    if exc.errno == errno.ETIMEDOUT and tid:
        return ForkError(f"pid {pid}: thread {tid} did not reach a ptrace stop within "
                         f"{bound:g} s at step {step!r} (in uninterruptible sleep?)", pid=pid,
                         step=step, errno=exc.errno)
    what = os.strerror(exc.errno) if exc.errno else str(exc)  # a CompelError's text names the step too
    return ForkError(f"pid {pid}: {what} at step {step!r}", pid=pid, step=step, errno=exc.errno)


@dataclass(frozen=True)
class ThreadState:
    """What a thread needs to be recreated in a child (see compel.h: struct bx_thread_state)."""

    tid: int
    vtid: int
    in_syscall: bool
    regs: dict[str, int]
    resume: dict[str, int]
    sigmask: int
    sigpending: int
    shdpending: int
    rseq: tuple[int, int, int, int]
    robust_list: tuple[int, int]
    tid_addr: int
    # read only on request (:meth:`Tracee.thread_altstack`, :meth:`Tracee.xstate`): each costs
    # an injection or 1-16 KiB, and only recreating the thread needs them
    altstack: tuple[int, int, int] | None = None  # (sp, flags, size)
    xstate: bytes | None = field(default=None, repr=False)


class Tracee:
    """One seized thread group. Use :meth:`seize`, preferably as a context manager: leaving
    the block cures and detaches, also on exception.

    ``wait_timeout`` (seconds, 0: none) bounds each wait for a report of one of its threads,
    and of the clones made through it: past it the step raises ForkError with errno ETIMEDOUT
    naming the thread. An injected call that blocks is interrupted (the victim sees it
    restarted or -EINTR, as after any signal) and cure puts the thread back; a thread whose
    seize stop did not come stays attached, its stop still asked for (:attr:`late`)."""

    def __init__(self, ctl: Any, clone_flags: int = 0, wait_timeout: float = 0.0) -> None:
        self._ctl = ctl
        self.pid: int = ctl.pid
        self.clone_flags = clone_flags  # what :meth:`clone` made it with (0: seized)
        self.wait_timeout = wait_timeout

    @classmethod
    def seize(cls, pid: int, wait_timeout: float = 0.0) -> Tracee:
        """Attach to ``pid`` and stop that thread; it becomes the one syscalls run in.
        ``wait_timeout`` bounds every later wait (see the class)."""
        try:
            t = cls(_compel().Ctl(pid))
        except OSError as exc:
            raise _translate(exc, pid) from None
        if wait_timeout:
            t.set_wait_timeout(wait_timeout)
        return t

    @classmethod
    def seize_frozen(cls, pid: int, wait_timeout: float = 0.0) -> Tracee:
        """Attach to a task frozen by the cgroup freezer and ask it to stop, without waiting:
        it stops when thawed. Call :meth:`wait_stopped` after thawing. Not for a frozen task
        :func:`in_group_stop`: its attach would wait for the thaw (seize it thawed)."""
        try:
            t = cls(_compel().Ctl(pid, False))
        except OSError as exc:
            raise _translate(exc, pid) from None
        t.set_wait_timeout(wait_timeout)
        return t

    def set_wait_timeout(self, seconds: float) -> None:
        """Bound each later wait for a report of a thread (see the class), 0: none."""
        self._call("set_wait_timeout", seconds)
        self.wait_timeout = seconds

    @property
    def late(self) -> list[int]:
        """Threads still attached after :meth:`detach` because the stop their seize asked for
        has not come (asleep uninterruptibly): :meth:`detach` again lets go of those that
        have stopped since."""
        return self._ctl.late() if self._ctl is not None else []

    def wait_stopped(self, timeout: float | None = None) -> int:
        """Second half of :meth:`seize_frozen`. ``timeout``: ForkError (step ``"wait"``) if
        the task has nothing to report by then (a task in uninterruptible sleep never does;
        it stays attached, its stop still asked for). Returns, with a ``timeout``, the signal
        that stopped the task's thread group (``kill -STOP``, Ctrl-Z) when its first report is
        that stop, else 0."""
        report = self._await_report(timeout) if timeout is not None else None
        self._call("seize_finish")
        if (report is not None and report.si_code == os.CLD_TRAPPED
                and report.si_status >> 8 == _PTRACE_EVENT_STOP
                and report.si_status & 0xFF != signal.SIGTRAP):
            return report.si_status & 0xFF
        return 0

    def _await_report(self, timeout: float):
        """The kernel's first report of the task (a stop or an exit), once it has one: WNOWAIT
        leaves it for compel's own (blocking) wait to collect. None: not ours to wait for."""
        deadline = time.monotonic() + timeout
        delay = 0.00002
        while True:
            try:
                report = os.waitid(os.P_PID, self.pid, _WAIT_ANY_REPORT)
            except ChildProcessError:
                return None  # gone: compel's wait says what happened
            if report is not None:
                return report
            if time.monotonic() >= deadline:
                raise ForkError(f"pid {self.pid}: no ptrace stop within {timeout:g} s of the seize "
                                "(in uninterruptible sleep?)", pid=self.pid, step="wait")
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    def _call(self, name: str, *args: Any, **kw: Any) -> Any:
        try:
            return getattr(self._ctl, name)(*args, **kw)
        except OSError as exc:
            raise _translate(exc, self.pid, self.wait_timeout) from None

    def __enter__(self) -> Tracee:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def seize_threads(self) -> None:
        """Attach to every other thread and ask each for a stop, without waiting: a frozen
        task's threads then stop before their next instruction once thawed (stop_all waits)."""
        self._call("seize_threads")

    def stop_all(self) -> list[int]:
        """Seize and stop every thread of the process, including threads born meanwhile."""
        self._call("stop_all")
        return self.threads()

    def threads(self) -> list[int]:
        """Tids of the seized threads; the injection thread first."""
        return self._call("threads")

    def syscall(self, nr: int, *args: int) -> int:
        """Run system call ``nr`` in the victim; returns its raw result (``-errno`` on failure)."""
        return self._call("syscall", nr, *args)

    # Batches (compel.h: bx_batch_seized). Each call is (nr, args, flags); flags combine:
    BATCH_OK_ERR = 1 << 24  # any error of this call lets the batch go on

    @staticmethod
    def batch_ref(i: int) -> int:
        """Flag: argument ``i`` is the index of an earlier call, whose result it becomes."""
        return 1 << (16 + i)

    @staticmethod
    def batch_ok_errno(err: int) -> int:
        """Flag: this one errno lets the batch go on (any other stops it)."""
        return err << 32

    @staticmethod
    def batch_code_size() -> int:
        """Bytes of executable memory :meth:`batch` needs at ``code_addr``."""
        return int(_compel().batch_code_size())

    def batch(self, code_addr: int, table_addr: int,
              calls: list[tuple[int, tuple[int, ...], int]]) -> list[int]:
        """Run ``calls`` in the victim in one stop: a small program copied to ``code_addr``
        (executable, :meth:`batch_code_size` bytes) walks a table at ``table_addr`` (writable,
        64 bytes per call and one more). Returns the raw results of the calls that ran: all,
        or up to and including the first that failed without a flag allowing it."""
        return self._call("batch", code_addr, table_addr,
                          [(nr | flags, tuple(args)) for nr, args, flags in calls])

    def calls(self, calls: list[tuple[int, tuple[int, ...], int]]) -> list[int]:
        """As :meth:`batch`, in memory of the Tracee's own (one page mapped on first need, kept
        out of the victim's forks, unmapped by :meth:`cure`) or, in a process that refuses
        writable+executable memory, one call at a time. At most :meth:`max_calls` calls."""
        return self._call("calls", [(nr | flags, tuple(args)) for nr, args, flags in calls])

    @staticmethod
    def max_calls() -> int:
        return int(_compel().page_max_calls())

    def page(self) -> tuple[int, int] | None:
        """``(addr, size)``: memory in the victim for the arguments of :meth:`calls`, valid
        until :meth:`cure`; None if the process refuses writable+executable memory."""
        return self._call("page")

    @contextlib.contextmanager
    def scratch(self) -> Iterator[int]:
        """A page of the victim's memory for a call's data while inside: the batch page (no
        mapping of ours), or a page mapped for the while where it refuses W+X memory."""
        page = self.page()
        if page is not None:
            yield page[0]
            return
        addr = self.mmap(_mmap.PAGESIZE)
        try:
            yield addr
        finally:
            self.munmap(addr, _mmap.PAGESIZE)

    def mmap(self, length: int, prot: int = _mmap.PROT_READ | _mmap.PROT_WRITE,
             flags: int = _mmap.MAP_PRIVATE | _mmap.MAP_ANONYMOUS, addr: int = 0, fd: int = -1,
             offset: int = 0) -> int:
        """Map memory in the victim; returns the address. Raises ForkError if mmap fails."""
        return self._call("mmap", length, prot, flags, addr, fd, offset)

    def munmap(self, addr: int, length: int) -> None:
        self._call("munmap", addr, length)

    def read(self, addr: int, n: int) -> bytes:
        """Read ``n`` bytes of the victim's memory."""
        return self._call("read", addr, n)

    def write(self, addr: int, data: bytes) -> None:
        """Write into the victim's memory (writable mappings only)."""
        self._call("write", addr, bytes(data))

    def recv_fds(self, sockfd: int, n: int, at: int | None = None,
                 flags: int = MSG_CMSG_CLOEXEC) -> tuple[bytes, list[int]]:
        """An injected ``recvmsg(sockfd)`` of one message carrying up to ``n`` descriptors:
        its bytes (64 at most) and the descriptors, installed in the victim. ``at``: where
        in the victim's writable memory the call's data may go (160 + 4n bytes), else a
        scratch page. Raises OSError with recvmsg's errno."""
        if at is not None:
            return self._recv_fds(sockfd, n, at, flags)
        with self.scratch() as page:
            return self._recv_fds(sockfd, n, page, flags)

    def _recv_fds(self, sockfd: int, n: int, at: int, flags: int) -> tuple[bytes, list[int]]:
        space = 16 + ((4 * n + 7) & ~7)  # CMSG_SPACE(4n)
        msg, iov, data, ctl = at, at + 64, at + 80, at + 144
        hdr = struct.pack("QI4xQQQQi4x", 0, 0, iov, 1, ctl, space, 0)
        self.write(msg, hdr.ljust(64, b"\0") + struct.pack("QQ", data, 64) + bytes(64 + space))
        got = self.syscall(_SYS_recvmsg, sockfd, msg, flags)
        if got < 0:
            raise OSError(-got, os.strerror(-got))
        body = self.read(data, got) if got else b""
        clen, level, kind = struct.unpack("QII", self.read(ctl, 16))
        if (level, kind) != (socket.SOL_SOCKET, socket.SCM_RIGHTS) or clen <= 16:
            return body, []
        return body, list(struct.unpack(f"{(clen - 16) // 4}i", self.read(ctl + 16, clen - 16)))

    def held_signals(self) -> list[int]:
        """Signals that arrived during injection and will be delivered after cure."""
        return self._call("held_signals")

    def thread_state(self, tid: int | None = None) -> ThreadState:
        """Registers, signal mask, rseq, robust list, cached tid address of a stopped thread."""
        return ThreadState(**self._call("thread_state", self.pid if tid is None else tid))

    def xstate(self, tid: int | None = None) -> bytes:
        """The thread's extended FPU/SSE/AVX state as the kernel's XSAVE image."""
        return self._call("xstate", self.pid if tid is None else tid)

    def clone(self, pidns_owner: int | None = None, set_tid: int | None = None,
              flags: int = 0, quiet_exit: bool = False, owe_robust: bool = False) -> Tracee:
        """Fork the victim from inside (clone3). ``pidns_owner``: a host pid whose pid
        namespace the child is created in; ``set_tid``: the child's pid there. The child
        comes back seized and stopped, as a Tracee of its own: use it as a context manager
        (or call :meth:`detach`) to let it run. ``quiet_exit``: the child's death sends no
        signal to its parent (it must then be reaped with ``__WALL``); required with
        CLONE_PARENT, whose child sends what the victim's death would send. ``owe_robust``:
        the child's robust list (fork drops it) is not set: the caller must, before it
        runs, with what :meth:`take_owed_robust` gives (in a batch it makes anyway: one
        stop less)."""
        ctl = self._call("clone", flags, pidns_owner or 0, set_tid or 0, quiet_exit, owe_robust)
        return Tracee(ctl, flags, self.wait_timeout)

    def learn(self) -> None:
        """Read now what a clone from this process needs to know of it (~30 us of reads),
        so that its first :meth:`clone` does not: for a Tracee made ahead of its use."""
        self._call("learn")

    def take_owed_robust(self) -> tuple[int, int] | None:
        """``(head, len)`` for the set_robust_list a clone made with ``owe_robust`` still
        needs, once; None when none is owed."""
        return self._call("take_owed_robust")

    def clone_by(self, make: Callable[[int], list[int]], vtids: list[int]) -> list[Tracee]:
        """Clones made outside compel: ``make(tid_addr)`` resumes this (stopped) process so that
        it clones itself and stops again, and returns the children's host pids (the kernel
        module's FORK does); ``tid_addr`` is where each child should store its tid. The children
        come back as :meth:`clone`'s do: seized, stopped, registers those of this process.
        ``vtids[i]`` is child i's pid in its own namespace (0: unknown). An OSError from ``make``
        is passed on once the children it made anyway (its ``made``) are killed and, when it has
        ``resumed`` this process, this process's stop is collected; on any failure no child is
        left."""
        addr = self._call("ext_clone_begin")
        try:
            pids = make(addr)
        except OSError as e:
            _kill_traced(getattr(e, "made", ()))
            if getattr(e, "resumed", False):
                self._call("ext_clone_end")
            raise
        self._call("ext_clone_end")
        out: list[Tracee] = []
        try:
            for pid, vtid in zip(pids, vtids):
                out.append(Tracee(self._call("ext_clone_adopt", pid, vtid),
                                  wait_timeout=self.wait_timeout))
        except BaseException:
            _kill_traced(pids)
            for t in out:
                t._ctl = None
            raise
        return out

    def run_by(self, make: Callable[[], R]) -> R:
        """Something made outside compel that resumes this (stopped) process and has it stop
        again without running user code (the kernel module's RUN): ``make()``'s result, once
        that stop is collected. Its OSError is passed on, after the stop when it has
        ``resumed`` the process."""
        try:
            out = make()
        except OSError as e:
            if getattr(e, "resumed", False):
                self._call("ext_clone_end")
            raise
        self._call("ext_clone_end")
        return out

    def thread_altstack(self, tid: int | None = None) -> tuple[int, int, int]:
        """The thread's alternate signal stack as ``(sp, flags, size)``, read by running
        sigaltstack in that thread (its registers are put back)."""
        return self._call("thread_altstack", self.pid if tid is None else tid)

    def clone_thread(self, state: ThreadState, set_tid: int = 0) -> int:
        """Recreate the thread ``state`` describes (read from the process this one was cloned
        from) in this process; returns its tid in our pid namespace. ``set_tid``: its tid in
        this process's own pid namespace (0: any). It stays stopped until :meth:`detach`."""
        spec = {f.name: getattr(state, f.name) for f in fields(ThreadState)}
        alt, xstate = spec.pop("altstack"), spec.pop("xstate")
        try:
            return self._ctl.clone_thread(spec, set_tid, alt, xstate)
        except OSError as exc:
            step = getattr(exc, "step", "clone_thread")
            want = f"tid {set_tid}" if set_tid else "a new tid"
            raise ForkError(f"pid {self.pid}: recreating thread {state.tid} as {want}: "
                            f"{exc.strerror} at step {step!r}", pid=self.pid, step=step,
                            errno=exc.errno) from None

    def clone_threads(self, source: Tracee) -> list[int]:
        """Recreate in this clone every thread of ``source`` (the seized process it was cloned
        from, all threads stopped) but the one it was cloned by; returns the new tids in
        ``source.threads()`` order. When this process has a pid namespace of its own each
        thread gets its source's tid there."""
        tids = source.threads()
        alive = {int(t) for t in os.listdir(f"/proc/{source.pid}/task")}
        if not alive <= set(tids):
            raise ForkError(f"pid {source.pid}: threads {sorted(alive - set(tids))} are not "
                            "stopped (call stop_all() before clone())", pid=source.pid,
                            step="clone_threads")
        own_ns = _pidns(self.pid) != _pidns(source.pid)
        main = source.thread_state(tids[0])
        if main.tid_addr:  # fork() leaves clear_child_tid unset; glibc's main thread has one
            self.syscall(_SYS_set_tid_address, main.tid_addr)
        out = []
        for tid in tids[1:]:
            if tid not in alive:  # exited while being stopped
                continue
            st = replace(_reissued(tid, source.thread_state(tid)),
                         altstack=source.thread_altstack(tid), xstate=source.xstate(tid))
            out.append(self.clone_thread(st, st.vtid if own_ns else 0))
        return out

    def thread_syscall(self, tid: int, nr: int, *args: int) -> int:
        """Run system call ``nr`` (at most four arguments) in thread ``tid`` of the victim, for
        what is the thread's own (its credentials); returns its raw result."""
        return self._call("thread_syscall", tid, nr, *args)

    def replace(self, regs: dict[str, int], xstate: bytes | None = None) -> None:
        """This process's memory was replaced from outside (a transplant): what compel put in
        the old one (batch page, patched bytes) is forgotten without being touched, and it
        resumes with ``regs`` (and the FPU state ``xstate``, when given) at :meth:`cure`; the
        syscall instruction injected calls run is looked for again (at ``regs``' call site,
        when stopped in a call there)."""
        self._call("replace", regs, xstate)

    def cure(self) -> None:
        """Restore registers and patched bytes and re-queue held signals; stay attached."""
        self._call("cure")

    def detach(self) -> None:
        """Cure if needed and let every thread run, untraced (but the :attr:`late` ones).
        Safe to call twice."""
        self._call("detach")

    @property
    def alive(self) -> bool:
        return bool(self._ctl.alive)

    @property
    def in_parent(self) -> int:
        """A clone's pid as the process that made it sees it (whom it can wait4 for)."""
        return int(self._ctl.in_parent)

    def __iter__(self) -> Iterator[int]:
        return iter(self.threads())


_PTRACE_EVENT_STOP = 128
_WAIT_ANY_REPORT = os.WSTOPPED | os.WEXITED | os.WNOWAIT | os.WNOHANG | 0x40000000  # __WALL


def in_group_stop(pid: int) -> bool | None:
    """Whether the (sleeping) task ``pid`` is stopped by a signal (``kill -STOP``, a shell job
    suspended with Ctrl-Z), also while the cgroup freezer holds it (its state then reads D,
    not T). Attaching to such a task waits, uninterruptibly, until it has left the stop for a
    ptrace stop, which a frozen task never does: seize it only once thawed. A task in that
    stop sleeps in do_signal_stop, as its wchan names it; None when wchan names nothing (a
    kernel without kallsyms) and the task is not gone."""
    try:
        with open(f"/proc/{pid}/wchan") as f:
            where = f.read().strip()
    except FileNotFoundError:
        return False  # gone: its seize says so
    except OSError:
        return None
    return None if where in ("", "0") else where == "do_signal_stop"


def _kill_traced(pids) -> None:
    """Kill stopped processes we trace and collect them as their tracer (their parents reap
    them): none of them may run on."""
    for pid in pids:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0x40000000)  # __WALL; cannot block: SIGKILL ends a ptrace-stopped task at once
        except (ProcessLookupError, ChildProcessError):
            pass


# The call each source thread was last seen interrupted in, by thread, call site and
# arguments: once the source runs on, the kernel makes it again as restart_syscall, and a later
# fork sees only that number. Bounded: forgetting costs only that fallback.
_interrupted_calls: dict[tuple[int, ...], int] = {}
_INTERRUPTED_CALLS_MAX = 4096


def _reissued(tid: int, st: ThreadState) -> ThreadState:
    """``st`` for a thread recreated in a clone, whose call the fork interrupted with the rest
    of its work in the kernel's per-task restart block (poll, a relative nanosleep, a timed
    futex wait): a new thread has its creator's block, not its source's, so it makes the call
    again from the start instead of restart_syscall. A sleep whose time left the kernel wrote
    to user space (nanosleep's remaining time) sleeps that; poll and futex waits wait their
    whole timeout again (an absolute one, as pthread_cond_timedwait's, is kept exactly). A
    restarted call whose number this process never saw, or one a signal queued to the thread
    itself ends (its handler makes it return EINTR in the source too), comes back as compel
    makes it: EINTR."""
    regs = st.regs
    if not st.in_syscall or regs["rax"] & _WORD != -_ERESTART_RESTARTBLOCK & _WORD:
        return st
    if st.sigpending & ~st.sigmask:
        return st
    key = (tid, regs["rip"], regs["rdi"], regs["rsi"], regs["rdx"], regs["r10"], regs["r8"],
           regs["r9"])
    nr = regs["orig_rax"]
    if nr == _SYS_restart_syscall:
        if key not in _interrupted_calls:
            return st
        nr = _interrupted_calls[key]
    else:
        if len(_interrupted_calls) >= _INTERRUPTED_CALLS_MAX:
            _interrupted_calls.clear()
        _interrupted_calls[key] = nr
    resume = dict(regs, rax=nr, orig_rax=_WORD, rip=regs["rip"] - _SYSCALL_INSN_LEN)
    if nr == _SYS_nanosleep and regs["rsi"]:
        resume["rdi"] = regs["rsi"]
    elif nr == _SYS_clock_nanosleep and regs["r10"]:
        resume["rdx"] = regs["r10"]
    return replace(st, in_syscall=False, resume=resume)


def _pidns(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/pid")
