"""Net, ipc and uts namespaces made ahead for the forks of a sandbox workspace.

A child's init may join only namespaces owned by its own user namespace U (runtime/userns.py),
so the trainer's pool (nspool.py), made in the trainer's user namespace, cannot serve it, and a
trainer thread cannot enter U (setns of a user namespace needs a single-threaded caller). One
helper process per trainer, single-threaded, makes them: for each set it forks a child that
enters U, unshares a net, ipc and uts namespace, brings its loopback up and hands the three
back by descriptor. Each U gets a pool of its own (:func:`pool_for`), filled by nspool's
refill thread through the helper, and emptied when the last workspace of U closes.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time

from . import nspool
from .nspool import NamespacePool, NsSet
from .perprocess import PerProcess

log = logging.getLogger("bunshin.fork")

_HELPER = r"""
import ctypes, fcntl, os, socket, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
sock = socket.socket(fileno=int(sys.argv[1]))
while True:
    try:
        _msg, fds, _flags, _addr = socket.recv_fds(sock, 1, 1)
    except OSError:
        break
    if not fds:
        break
    pid = os.fork()
    if pid == 0:
        try:
            if libc.setns(fds[0], 0x10000000) or libc.unshare(0x40000000 | 0x08000000 | 0x04000000):
                raise OSError(ctypes.get_errno(), "setns(user)/unshare(net|ipc|uts)")
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                req = struct.pack("16sH14x", b"lo", 0)
                flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), 0x8913, req))[1]
                fcntl.ioctl(s.fileno(), 0x8914, struct.pack("16sH14x", b"lo", flags | 0x41))
            made = [os.open(f"/proc/self/ns/{n}", os.O_RDONLY) for n in ("net", "ipc", "uts")]
            socket.send_fds(sock, [b"k"], made)
        except OSError as e:
            sock.send(f"e{e}".encode())
        os._exit(0)
    os.close(fds[0])
    os.waitpid(pid, 0)
"""


class _Helper:
    """The helper process and the trainer's end of its socket (one request at a time)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", _HELPER, str(theirs.fileno())],
                                         pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        finally:
            theirs.close()
        self.sock = ours
        self.lock = threading.Lock()

    def make_in(self, userns_fd: int) -> NsSet:
        with self.lock:
            socket.send_fds(self.sock, [b"m"], [userns_fd])
            msg, fds, _flags, _addr = socket.recv_fds(self.sock, 512, 3)
        if len(fds) != 3:
            for fd in fds:
                os.close(fd)
            raise OSError(0, f"the namespace helper: {msg[1:].decode(errors='replace') or 'gone'}")
        for fd in fds:
            os.set_inheritable(fd, False)
        return NsSet(*fds)


_helper = PerProcess(_Helper)


class _SandboxPool(NamespacePool):
    """Refilled once a set is taken (the trainer's pool's refill calls, after a batch of
    forks, do not reach this one), a moment later: a namespace made while the fork that took
    the set runs would slow it (both take the kernel's network locks)."""

    _due = 0.0

    def take(self) -> NsSet | None:
        got = super().take()
        self._due = time.monotonic() + _REFILL_AFTER
        self.refill()
        return got

    def _before_make(self) -> None:
        wait = self._due - time.monotonic()
        if wait > 0:
            time.sleep(wait)


_REFILL_AFTER = 0.1  # s: past the next forks of a loop (a refill during one slows it: at 20 ms a
# template's forks in a loop took 1.5-1.7x a trusted one's, at 100 ms 1.0x; bench/runtime.py)


def _the_helper() -> _Helper:
    h = _helper.get()
    assert h is not None  # _Helper() is never None
    return h


def pool_for(userns) -> NamespacePool | None:
    """The pool of sandbox user namespace ``userns`` (a runtime.userns.UserNs), made on first
    use; None when pools are off."""
    trainers = nspool.pool()
    if trainers is None:  # BUNSHIN_NS_POOL=0: none for sandboxes either
        return None
    with userns.lock:
        if userns.pool is None and userns.fd >= 0:
            fd = userns.fd
            userns.pool = _SandboxPool(trainers.size, make=lambda: _the_helper().make_in(fd))
        return userns.pool
