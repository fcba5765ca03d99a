"""Net, ipc and uts namespaces made ahead of forks.

Creating a network namespace costs ~0.5 ms here (ipc 0.13, uts 0.1): a fifth of a small
fork, spent before the child exists. One background thread makes them ahead of time and keeps
them alive by file descriptor; a fork takes one set and the child's init joins it with setns
(REROOT), so only the pid and mount namespaces are made on the fork's path. When the pool is
empty (a burst of forks) the child's init is cloned with fresh namespaces as before.

A namespace is per thread: the refill thread unshares itself into each new set and never runs
anything else. The loopback interface is brought up there, as a workspace's init does.

``BUNSHIN_NS_POOL`` sets how many sets wait ready (default 4; 0 turns the pool off).
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .. import config
from ..runtime.userns import live
from .perprocess import PerProcess

log = logging.getLogger("bunshin.fork")

CLONE_NEWNET, CLONE_NEWIPC, CLONE_NEWUTS = 0x40000000, 0x08000000, 0x04000000
POOLED = CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP, _IFF_RUNNING = 0x8913, 0x8914, 0x1, 0x40
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass
class NsSet:
    """Descriptors of one unused net, ipc and uts namespace (the order REROOT takes them)."""

    net: int
    ipc: int
    uts: int

    def fds(self) -> list[int]:
        return [self.net, self.ipc, self.uts]

    def close(self) -> None:
        for fd in self.fds():
            try:
                os.close(fd)
            except OSError:
                pass


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP | _IFF_RUNNING))


def make_set() -> NsSet:
    """New namespaces for the calling thread, returned as descriptors (the thread stays in
    them: call only from a thread that does nothing else)."""
    if _libc.unshare(POOLED) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"unshare(net|ipc|uts): {os.strerror(e)}")
    _loopback_up()
    fds = []
    try:
        for ns in ("net", "ipc", "uts"):
            fds.append(os.open(f"/proc/thread-self/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return NsSet(*fds)


class NamespacePool:
    """Up to ``size`` ready namespace sets, refilled by one daemon thread with ``make``
    (default: in the trainer's user namespace, by the thread itself)."""

    def __init__(self, size: int, make: Callable[[], NsSet] | None = None) -> None:
        self.size = size
        self._make = make or make_set
        self._closed = False
        self._ready: list[NsSet] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._broken: str | None = None
        self.taken = self.missed = 0

    def take(self) -> NsSet | None:
        """A ready set (the caller owns and closes it), or None: make fresh ones."""
        with self._cv:
            if self._thread is None and self._broken is None:
                self._thread = threading.Thread(target=self._refill, name="bunshin-nspool", daemon=True)
                self._thread.start()
            got = self._ready.pop() if self._ready else None
            if got is None:
                self.missed += 1
            else:
                self.taken += 1
            return got

    def refill(self) -> None:
        """Make up for what was taken, now: call once a batch of forks is done. Refilling
        while a fork runs would slow it (both need the kernel's network locks)."""
        with self._cv:
            self._cv.notify()

    def _refill(self) -> None:
        while True:
            with self._cv:
                if len(self._ready) >= self.size and not self._closed:
                    self._cv.wait()
                if self._closed:
                    self._thread = None
                    return
                if len(self._ready) >= self.size:
                    continue
            self._before_make()
            try:
                s = self._make()
            except OSError as e:
                # Forks still work (fresh namespaces per fork); say why once and stop trying.
                if not self._closed:  # (a closed pool's maker may fail on its way out)
                    log.warning("namespace pool off: %s", e)
                with self._cv:
                    self._broken = str(e)
                    self._thread = None
                return
            with self._cv:
                if self._closed:
                    s.close()
                else:
                    self._ready.append(s)

    def _before_make(self) -> None:
        """Called by the thread before it makes a set (a subclass may wait there)."""

    def close(self) -> None:
        """No more sets: the thread ends and the ready ones are closed."""
        with self._cv:
            self._closed = True
            self._broken = "closed"
            self._cv.notify()
        self.drain()

    def drain(self) -> None:
        """Close every ready set (the thread makes new ones when forks take again)."""
        with self._cv:
            ready, self._ready = self._ready, []
        for s in ready:
            s.close()


def _make_pool() -> NamespacePool | None:
    size = config.ns_pool_size()
    return NamespacePool(size) if size > 0 else None


_pool = PerProcess(_make_pool)


def pool() -> NamespacePool | None:
    """The process's pool, or None when ``BUNSHIN_NS_POOL=0``."""
    return _pool.get()


_own_userns = PerProcess(lambda: os.stat("/proc/self/ns/user").st_ino)


def pool_for(init_pid: int) -> NamespacePool | None:
    """The pool whose namespaces the child of the template whose init is ``init_pid`` may
    join: ours are owned by the trainer's user namespace, which a sandbox workspace's init
    (in a user namespace of its own, runtime/userns.py) has no power in; a sandbox's come
    from a pool of its user namespace (nsmaker.py)."""
    ino = os.stat(f"/proc/{init_pid}/ns/user").st_ino
    if ino == _own_userns.get():
        return pool()
    from .nsmaker import pool_for as sandbox_pool  # it builds on this module

    u = live(ino)
    return sandbox_pool(u) if u is not None else None
