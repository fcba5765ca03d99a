"""System calls the fork engine runs inside a stopped clone, with scratch memory for the
strings and structures they take. Every failure is a ForkError naming the process and step.

Calls whose result nobody needs at once are queued (:meth:`Remote.queue` returns a :class:`Ref`)
and run together in one stop (compel's batch) when something needs a result: reading a Ref's
value, a plain :meth:`Remote.call`, touching the Tracee (``r.t``), or :meth:`Remote.flush`.
So the order of the calls in the process is the order they were asked for. Given the kernel
module's RUN (:class:`RunRemote`), a queue runs in the kernel instead, made by the process itself in one resume: no
scratch memory is mapped in it for the queue, and its data travels with the call.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import mmap as _mmap
import os
import struct
from typing import TYPE_CHECKING
from collections.abc import Iterator

from .._core import _kmod, kmod
from ..compel import Tracee
from ..errors import ForkError
from .plan import FdInfo

if TYPE_CHECKING:
    from .._core.kmod import Kmod

# x86_64 system call numbers
SYS = {
    "close": 3, "lseek": 8, "ioctl": 16, "dup3": 292, "fcntl": 72, "chdir": 80, "setsid": 112,
    "setpgid": 109, "openat": 257, "pipe2": 293, "setns": 308, "pidfd_open": 434, "wait4": 61,
    "getpid": 39, "set_tid_address": 218, "tee": 276, "mmap": 9, "ftruncate": 77,
    "memfd_create": 319, "getitimer": 36, "setitimer": 38, "kill": 62, "tgkill": 234,
    "shmat": 30, "read": 0, "signalfd4": 289, "inotify_init1": 294, "inotify_add_watch": 254,
    "inotify_rm_watch": 255, "timer_create": 222, "timer_settime": 223, "timer_gettime": 224, "timer_delete": 226,
    "pidfd_getfd": 438, "eventfd2": 290, "write": 1, "timerfd_create": 283, "timerfd_settime": 286,
    "epoll_create1": 291, "epoll_ctl": 233, "socket": 41, "socketpair": 53, "bind": 49, "listen": 50,
    "unlinkat": 263, "shutdown": 48, "rt_sigaction": 13,
    "set_robust_list": 273, "sched_setaffinity": 203, "semctl": 66,
    "fchmod": 91, "fchown": 93, "fchdir": 81, "mkdirat": 258, "mknodat": 259, "flock": 73,
    "fchmodat": 268, "fchownat": 260, "linkat": 265, "symlinkat": 266,
    "munmap": 11, "mlock2": 325, "mlockall": 151, "prctl": 157,
    "sigaltstack": 131, "rseq": 334, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297,
}
AT_FDCWD = -100
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWNET = 0x00020000, 0x04000000, 0x08000000, 0x40000000
CLONE_NEWCGROUP = 0x02000000
TIOCSCTTY = 0x540E
ANY_ERROR = tuple(range(1, 4096))  # ok_errnos: no error stops a queue (check the Ref after)
F_SETFL, F_GETFL = 4, 3
_RESTART_FIRST, _RESTART_LAST = 512, 516  # the kernel's ERESTARTSYS .. ERESTART_RESTARTBLOCK


class Ref:
    """The result of a queued call; reading ``value`` runs the queue if it has not run yet.
    Passed as an argument to a later queued call it becomes a reference the batch resolves
    inside the process."""

    __slots__ = ("_r", "_index", "_value", "_call")

    def __init__(self, r: Remote, index: int, value: int | None = None, call: tuple = ()) -> None:
        self._r, self._index, self._value, self._call = r, index, value, call

    @property
    def value(self) -> int:
        if self._value is None:
            self._r.flush()
        if self._value is None:
            raise ForkError(f"{self._r.what}: the result of a call that never ran", pid=self._r._t.pid,
                            step="batch")
        return self._value

    def check(self) -> int:
        """The value; a failure raises as :meth:`Remote.call` would (for an ANY_ERROR call)."""
        v = self.value
        if -4096 < v < 0:
            name, args = self._call
            raise self._r._fail(name, tuple(a.value if isinstance(a, Ref) else a for a in args), v)
        return v

    def __repr__(self) -> str:
        return "?" if self._value is None else str(self._value)


class _Data:
    """Where a queued call's data will be: an offset into the queue's data, placed at flush
    (in the scratch page, or in the memory RUN maps)."""

    __slots__ = ("offset",)

    def __init__(self, offset: int) -> None:
        self.offset = offset

    def __repr__(self) -> str:
        return f"<data+{self.offset}>"


class Remote:
    """Syscalls in one stopped process (a :class:`Tracee`), raising on failure.

    Scratch memory, mapped on first use: page 0 holds the batch program and its table (so it
    is mapped executable), page 1 the data of queued calls, page 2 that of plain calls. A
    process that refuses writable+executable memory still works, one call at a time."""

    PAGE = 4096
    _CODE = 128  # the batch program, then its table of 64-byte entries, one per call + an end
    MAX_QUEUE = (PAGE - _CODE) // 64 - 1

    def __init__(self, t: Tracee, what: str) -> None:
        self._t = t
        self.what = what
        self._page = 0
        self._batched = True  # the page is executable
        self._queue: list[tuple[str, tuple, tuple[int, ...], Ref]] = []
        self._data = bytearray()  # page 1 as the queue wants it: written once, at flush

    @property
    def t(self) -> Tracee:
        """The Tracee, for direct use: anything queued runs first."""
        self.flush()
        return self._t

    def _scratch(self) -> int:
        if not self._page:
            try:
                self._page = self._t.mmap(3 * self.PAGE, _mmap.PROT_READ | _mmap.PROT_WRITE | _mmap.PROT_EXEC)
            except ForkError as e:
                if e.errno not in (_errno.EPERM, _errno.EACCES):
                    raise
                self._page = self._t.mmap(3 * self.PAGE)
                self._batched = False
        return self._page

    def _overdue(self, e: ForkError, calls: str) -> ForkError:
        """compel's error for an injected call that did not return within the Tracee's wait
        bound, naming the call: compel interrupted it and the process is put back."""
        if e.errno != _errno.ETIMEDOUT:
            return e
        return ForkError(f"{self.what}: {calls} did not return within {self._t.wait_timeout:g} s "
                         "(blocked in the kernel?)", pid=self._t.pid, step=e.step, errno=e.errno)

    def _fail(self, name: str, args: tuple, r: int) -> ForkError:
        return ForkError(f"{self.what}: {name}{args}: {os.strerror(-r)}", pid=self._t.pid, step=name, errno=-r)

    def call(self, name: str, *args: int | Ref, ok_errnos: tuple[int, ...] = ()) -> int:
        if any(isinstance(a, _Data) for a in args):
            raise ForkError(f"{self.what}: {name}: queued data given to a plain call (use put)")
        self.flush()
        values = tuple(a.value if isinstance(a, Ref) else a for a in args)
        try:
            r = self._t.syscall(SYS[name], *values)
        except ForkError as e:
            raise self._overdue(e, f"{name}{values}") from None
        if -4096 < r < 0 and -r not in ok_errnos:
            raise self._fail(name, values, r)
        return r

    def queue(self, name: str, *args: int | Ref | _Data, ok_errnos: tuple[int, ...] = ()) -> Ref:
        """Like :meth:`call`, but run later, with the rest of the queue (errors are raised
        then); ``args`` may include data placed by :meth:`queue_put`. A call allowed several
        errnos (but not ANY_ERROR) runs now: the batch can tell only one from the others, and
        any other must stop it; such a call cannot take queued data."""
        if len(ok_errnos) > 1 and ok_errnos is not ANY_ERROR:
            plain = tuple(a for a in args if not isinstance(a, _Data))
            if len(plain) < len(args):
                raise ForkError(f"{self.what}: {name}: queued data given to a call run now (several ok_errnos)")
            return Ref(self, -1, self.call(name, *plain, ok_errnos=ok_errnos), (name, args))
        ref = Ref(self, len(self._queue), None, (name, args))
        self._queue.append((name, args, ok_errnos, ref))
        if len(self._queue) == self.MAX_QUEUE:  # the table is full (its data is placed)
            self.flush()
        return ref

    @contextlib.contextmanager
    def batch(self) -> Iterator[Remote]:
        """``with r.batch() as b: b.queue(...)``: the calls queued in the block have run at
        its end (unless it raised)."""
        yield self
        self.flush()

    def flush(self) -> None:
        """Run the queued calls, in one stop; raises as :meth:`call` for the first that failed
        (the calls after it did not run)."""
        q, self._queue = self._queue, []
        data, self._data = bytes(self._data), bytearray()
        if not q:
            return
        done = self._ran_first(q, data)
        if done < len(q):  # no RUN, or it stopped at a call a signal interrupted
            rest = q[done:]
            page = self._scratch()
            if data:
                self._t.write(page + self.PAGE, data)
            try:
                if self._batched:
                    rets = self._t.batch(page, page + self._CODE, [self._entry(e, page, done) for e in rest])
                else:
                    rets = self._one_by_one(rest, page, done)
            except ForkError as e:
                raise self._overdue(e, " or ".join(name for name, *_ in rest)) from None
            self._settle(rest, rets)

    def _ran_first(self, q: list, data: bytes) -> int:
        """How many of the queue ran before injection, settled: none here (RunRemote's)."""
        return 0

    def _settle(self, q: list, rets: list[int]) -> int:
        """Give each call that ran its result, raising for the first that failed; returns how
        many are settled, short of a restart code (RUN: a signal interrupted that call)."""
        for i, ((name, args, ok, ref), r) in enumerate(zip(q, rets)):
            if -_RESTART_LAST <= r <= -_RESTART_FIRST:
                return i
            ref._value = r
            if -4096 < r < 0 and -r not in ok:
                raise self._fail(name, tuple(a.value if isinstance(a, Ref) else a for a in args), r)
        return len(rets)

    def _pending(self, name: str, i: int, a: Ref) -> int:
        """The queue index of a result still to come, which must be this queue's."""
        if a._r is not self or a._index < 0:
            raise ForkError(f"{self.what}: {name}: argument {i} is another queue's result")
        return a._index

    def _entry(self, e: tuple, page: int, base: int = 0) -> tuple[int, tuple[int, ...], int]:
        name, args, ok, _ = e
        flags = self._t.BATCH_OK_ERR if ok is ANY_ERROR else self._t.batch_ok_errno(ok[0]) if ok else 0
        out = []
        for i, a in enumerate(args):
            if isinstance(a, Ref) and a._value is None:
                flags |= self._t.batch_ref(i)
                a = self._pending(name, i, a) - base
            elif isinstance(a, Ref):
                a = a._value
            elif isinstance(a, _Data):
                a = page + self.PAGE + a.offset
            out.append(a)
        return SYS[name], tuple(out), flags

    def _one_by_one(self, q: list, page: int, base: int = 0) -> list[int]:
        rets: list[int] = []
        for name, args, ok, _ in q:
            r = self._t.syscall(SYS[name], *(rets[a._index - base] if isinstance(a, Ref) and a._value is None else
                                             a.value if isinstance(a, Ref) else
                                             page + self.PAGE + a.offset if isinstance(a, _Data) else a
                                             for a in args))
            rets.append(r)
            if -4096 < r < 0 and -r not in ok:
                break
        return rets

    def put(self, data: bytes, offset: int = 0) -> int:
        """Copy ``data`` to the scratch page of plain calls; returns its address in the process."""
        if offset + len(data) > self.PAGE:
            raise ForkError(f"{self.what}: argument of {len(data)} bytes is too long for the scratch page")
        addr = self._scratch() + 2 * self.PAGE + offset
        self._t.write(addr, data)
        return addr

    def path(self, p: str, offset: int = 0) -> int:
        return self.put(os.fsencode(p) + b"\0", offset)

    def queue_put(self, data: bytes) -> _Data:
        """Place ``data`` with the queued calls (copied into the process when they run); the
        result stands for its address there, as an argument of a queued call only."""
        size = (len(data) + 7) & ~7
        if len(self._data) + size > self.PAGE:
            self.flush()  # frees the page (one data argument per call: none is half-placed)
        if size > self.PAGE:
            raise ForkError(f"{self.what}: argument of {len(data)} bytes is too long for the scratch page")
        at = _Data(len(self._data))
        self._data += data.ljust(size, b"\0")
        return at

    def queue_path(self, p: str) -> _Data:
        return self.queue_put(os.fsencode(p) + b"\0")

    def openat(self, path: str, flags: int, mode: int = 0) -> int:
        return self.call("openat", AT_FDCWD & 0xFFFFFFFFFFFFFFFF, self.path(path), flags, mode)

    def queue_openat(self, path: str, flags: int, mode: int = 0) -> Ref:
        return self.queue("openat", AT_FDCWD & 0xFFFFFFFFFFFFFFFF, self.queue_path(path), flags, mode)

    def install(self, newfd: int | Ref, f: int | FdInfo) -> None:
        """Move ``newfd`` to descriptor ``f`` (a number, or the plan's FdInfo), replacing the
        inherited descriptor there and keeping its close-on-exec flag. The flag is read in the
        clone (/proc's fdinfo shows O_CLOEXEC from open(), which dup2 does not carry, so it
        cannot be trusted) once per template: the plan's FdInfo remembers it for later forks,
        which queue the whole move."""
        fd = f if isinstance(f, int) else f.fd
        cloexec = None if isinstance(f, int) else f.cloexec
        if cloexec is None:
            fdflags = self.call("fcntl", fd, 1, 0, ok_errnos=(9,))  # F_GETFD; EBADF: none there
            cloexec = bool(fdflags > 0 and fdflags & 1)
            if not isinstance(f, int):
                f.cloexec = cloexec
        # A result still queued is a new descriptor, never fd: the clone inherited fd (were
        # it free after all, dup3 would fail with EINVAL rather than do something else).
        if isinstance(newfd, Ref) and newfd._value is not None:
            newfd = newfd._value
        if isinstance(newfd, Ref) or newfd != fd:
            self.queue("dup3", newfd, fd, os.O_CLOEXEC if cloexec else 0)
            self.queue("close", newfd)
        elif not cloexec:
            self.queue("fcntl", fd, 2, 0)  # F_SETFD 0

    def dup_same(self, src: int, f: int | FdInfo) -> None:
        """Descriptor ``f`` shares ``src``'s open file, as in the template (dup)."""
        self.install(self.queue("fcntl", src, 1030, 0), f)  # F_DUPFD_CLOEXEC

    def pipe(self) -> tuple[int, int]:
        addr = self.put(bytes(8))
        self.call("pipe2", addr, os.O_CLOEXEC)
        return struct.unpack("ii", self.t.read(addr, 8))

    def release(self) -> None:
        """Unmap the scratch memory; what is still queued is dropped (call :meth:`flush`
        first: on success the engine has, on failure the process is about to go)."""
        self._queue, self._data = [], bytearray()
        if self._page:
            try:
                self._t.munmap(self._page, 3 * self.PAGE)
            except ForkError:
                pass
            self._page = 0



class RunRemote(Remote):
    """A Remote whose queues the process makes itself in the kernel (the module's RUN): one
    resume, no scratch memory, the data travelling with the call. A queue with a call RUN
    does not make, or the rest of one a signal interrupted, is injected as by a Remote."""

    def __init__(self, t: Tracee, what: str, k: Kmod) -> None:
        super().__init__(t, what)
        self._k = k

    def _ran_first(self, q: list, data: bytes) -> int:
        if not all(SYS[e[0]] in _kmod.RUN_SYSCALLS for e in q):
            return 0
        rets = self._in_kernel(q, data)
        return 0 if rets is None else self._settle(q, rets)

    def _in_kernel(self, q: list, data: bytes) -> list[int] | None:
        """The queue made by the process itself, in the kernel (RUN): one resume, no scratch.
        None when a signal is pending for it (it would stop for that first): injected then."""
        calls = []
        for name, args, ok, _ in q:
            flags = _kmod.RUN_OK_ANY if ok is ANY_ERROR else 0
            out = []
            for i, a in enumerate(args):
                if isinstance(a, Ref) and a._value is None:
                    flags |= _kmod.RUN_ARG_RESULT[i]
                    a = self._pending(name, i, a)
                elif isinstance(a, Ref):
                    a = a._value
                elif isinstance(a, _Data):
                    flags |= _kmod.RUN_ARG_DATA[i]
                    a = a.offset
                out.append(a)
            calls.append((SYS[name], tuple(out), flags, ok[0] if ok and ok is not ANY_ERROR else 0))
        t = self._t
        try:
            return t.run_by(lambda: self._k.run(t.pid, calls, data))
        except OSError as e:
            if e.errno == _errno.EAGAIN and not getattr(e, "resumed", False):
                return None
            raise ForkError(f"{self.what}: /dev/bunshin RUN of {len(calls)} calls "
                            f"({', '.join(c[0] for c in q)}): {kmod.why(e)}", pid=t.pid, step="run",
                            errno=e.errno) from None


def set_affinity(r: Remote, cpus: set[int], tid: int = 0) -> None:
    """Queue the clone's move onto ``cpus`` (its calling thread, so threads it gets later
    inherit them; or its thread ``tid``, as its pid namespace numbers it)."""
    size = (max(cpus) // 64 + 1) * 8
    mask = sum(1 << c for c in cpus).to_bytes(size, "little")
    r.queue("sched_setaffinity", tid, size, r.queue_put(mask))


def enter_namespaces(r: Remote, cwd: str, setns: bool = True) -> None:
    """Join the namespaces of the child's init (pid 1 of the clone's own pid namespace) and
    return to the working directory: setns(mnt) resets it to the new root. Queued: a failed
    setns surfaces at the next flush, its pidfd left open in a process the failure kills.
    ``setns=False``: the clone was made in them (FORK IN_PARENT), at the init's working
    directory: only the chdir."""
    if setns:
        pfd = r.queue("pidfd_open", 1, 0)
        # the init's cgroup namespace: a sandbox's child's own (init.c), else the host's
        r.queue("setns", pfd, CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP)
        r.queue("close", pfd)
    r.queue("chdir", r.queue_path(cwd), ok_errnos=(_errno.ENOENT,))
