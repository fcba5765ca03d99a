"""System calls the fork engine runs inside a stopped clone, with a scratch page for the
strings and structures they take. Every failure is a ForkError naming the process and step."""

from __future__ import annotations

import errno as _errno
import os
import struct

from ..compel import Tracee
from ..errors import ForkError
from .plan import FdInfo

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
    "unlinkat": 263, "shutdown": 48,
}
AT_FDCWD = -100
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWNET = 0x00020000, 0x04000000, 0x08000000, 0x40000000
TIOCSCTTY = 0x540E
F_SETFL, F_GETFL = 4, 3


class Remote:
    """Syscalls in one stopped process (a :class:`Tracee`), raising on failure."""

    PAGE = 4096

    def __init__(self, t: Tracee, what: str) -> None:
        self.t = t
        self.what = what
        self._page = 0

    def _scratch(self) -> int:
        if not self._page:
            self._page = self.t.mmap(self.PAGE)
        return self._page

    def call(self, name: str, *args: int, ok_errnos: tuple[int, ...] = ()) -> int:
        r = self.t.syscall(SYS[name], *args)
        if -4096 < r < 0 and -r not in ok_errnos:
            raise ForkError(f"{self.what}: {name}{args}: {os.strerror(-r)}", pid=self.t.pid, step=name,
                            errno=-r)
        return r

    def put(self, data: bytes, offset: int = 0) -> int:
        """Copy ``data`` to the scratch page; returns its address in the process."""
        if offset + len(data) > self.PAGE:
            raise ForkError(f"{self.what}: argument of {len(data)} bytes is too long for the scratch page")
        addr = self._scratch() + offset
        self.t.write(addr, data)
        return addr

    def path(self, p: str, offset: int = 0) -> int:
        return self.put(os.fsencode(p) + b"\0", offset)

    def openat(self, path: str, flags: int, mode: int = 0) -> int:
        return self.call("openat", AT_FDCWD & 0xFFFFFFFFFFFFFFFF, self.path(path), flags, mode)

    def install(self, newfd: int, f: int | FdInfo) -> None:
        """Move ``newfd`` to descriptor ``f`` (a number, or the plan's FdInfo), replacing the
        inherited descriptor there and keeping its close-on-exec flag. The flag is read in the
        clone (/proc's fdinfo shows O_CLOEXEC from open(), which dup2 does not carry, so it
        cannot be trusted) once per template: the plan's FdInfo remembers it for later forks."""
        fd = f if isinstance(f, int) else f.fd
        cloexec = None if isinstance(f, int) else f.cloexec
        if cloexec is None:
            fdflags = self.call("fcntl", fd, 1, 0, ok_errnos=(9,))  # F_GETFD; EBADF: none there
            cloexec = bool(fdflags > 0 and fdflags & 1)
            if not isinstance(f, int):
                f.cloexec = cloexec
        if newfd != fd:
            self.call("dup3", newfd, fd, os.O_CLOEXEC if cloexec else 0)
            self.call("close", newfd)
        elif not cloexec:
            self.call("fcntl", fd, 2, 0)  # F_SETFD 0

    def dup_same(self, src: int, fd: int) -> None:
        """``fd`` shares ``src``'s open file, as in the template (dup)."""
        self.install(self.call("fcntl", src, 1030, 0), fd)  # F_DUPFD_CLOEXEC

    def pipe(self) -> tuple[int, int]:
        addr = self.put(bytes(8))
        self.call("pipe2", addr, os.O_CLOEXEC)
        return struct.unpack("ii", self.t.read(addr, 8))

    def release(self) -> None:
        if self._page:
            try:
                self.t.munmap(self._page, self.PAGE)
            except ForkError:
                pass
            self._page = 0


def enter_namespaces(r: Remote, cwd: str) -> None:
    """Join the namespaces of the child's init (pid 1 of the clone's own pid namespace) and
    return to the working directory: setns(mnt) resets it to the new root."""
    pfd = r.call("pidfd_open", 1, 0)
    try:
        r.call("setns", pfd, CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)
    finally:
        r.call("close", pfd)
    r.call("chdir", r.path(cwd), ok_errnos=(_errno.ENOENT,))
