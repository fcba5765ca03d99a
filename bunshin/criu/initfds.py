"""Making a workspace's init dumpable by CRIU, and undoing it (syscalls injected with compel).

CRIU needs three things the init does not give it as it runs:

- **A session inside the pid namespace.** The init inherits the trainer's session; CRIU refuses
  a root task whose session leader is outside its namespace. The init calls ``setsid()``
  (harmless: it has no terminal; tool calls start their own sessions anyway).
- **No socket of the host's network namespace.** The control socket (fd 3) was made by the
  trainer, in the host's netns, where CRIU (sock_diag per netns) cannot see it. For the length
  of the dump fd 3 is swapped for one end of a socketpair made in the workspace's netns, whose
  other end the trainer keeps (claimed by Bunshin's CRIU plugin, :mod:`bunshin.criu.plugin`;
  without it an ``external`` ``unix[ino]``); the real control socket waits in the trainer
  (``pidfd_getfd``) and is put back afterwards. On restore the plugin puts a fresh control
  socket in its place (an image dumped without it: ``inherit_fd``).
- **The masters of the shells' terminals.** They live in the trainer, so CRIU would find pty
  slaves without masters. Copies are handed to the init for the dump and closed afterwards; a
  restored init holds them at the same fds, the trainer takes them (``pidfd_getfd``) and closes
  them in the init.

Fds travel into the init over its own socket: the trainer sends them with ``SCM_RIGHTS`` and a
``recvmsg`` is injected into the (stopped) init, so the init's own loop never sees the message.
A tool call issued while a dump runs waits (its request stays queued) — or, if it was queued
before the dump began, makes the dump fail cleanly: the message is checked.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass, field

from ..compel import MSG_CMSG_CLOEXEC, Tracee
from ..errors import CheckpointError
from ..fork.resources.sharing import getfd_here

_SYS_close, _SYS_setsid, _SYS_prctl, _SYS_dup3 = 3, 112, 157, 292
_PR_SET_MEMORY_MERGE = 67
_MAGIC = b"bunshin-criu-fds"
CTL_FD = 3


def in_netns(pid: int, fn):
    """Run ``fn()`` in a thread that has joined ``pid``'s network namespace."""
    box: dict = {}

    def body() -> None:
        try:
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(fd, 0x40000000)  # CLONE_NEWNET
            finally:
                os.close(fd)
            box["v"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["e"] = e

    t = threading.Thread(target=body, name="bunshin-criu-netns")
    t.start()
    t.join()
    if "e" in box:
        raise box["e"]
    return box["v"]


def _setns(fd: int, nstype: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, nstype) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"setns: {os.strerror(e)}")


def _recv_fds(t: Tracee, sockfd: int, n: int) -> list[int]:
    """Inject ``recvmsg(sockfd)`` into the stopped ``t`` for one message carrying ``n`` fds."""
    try:
        body, fds = t.recv_fds(sockfd, n, flags=MSG_CMSG_CLOEXEC | socket.MSG_DONTWAIT)
    except OSError as e:
        raise CheckpointError(f"init pid {t.pid}: recvmsg of the handed-over fds: {e.strerror}") from None
    if body != _MAGIC or len(fds) != n:
        for fd in fds:
            t.syscall(_SYS_close, fd)
        raise CheckpointError(f"init pid {t.pid}: the workspace's control socket carried a request "
                              "of a concurrent tool call; do not use a workspace while it is dumped")
    return fds


def _install(t: Tracee, fd: int, at: int) -> None:
    r = t.syscall(_SYS_dup3, fd, at, os.O_CLOEXEC)
    if r < 0:
        raise CheckpointError(f"init pid {t.pid}: dup3({fd}, {at}): {os.strerror(-r)}")
    t.syscall(_SYS_close, fd)


@dataclass
class Prepared:
    """What :func:`prepare` changed in an init, for :func:`undo` and the image's metadata."""

    init_pid: int
    ctl: socket.socket            # the trainer's end of the control socket (the Channel's)
    stand_in: socket.socket       # our end of the workspace-netns pair
    saved: int = -1               # the init's end of the real control socket, kept here
    stand_in_ino: int = 0         # the init's end of that pair, dumped as external
    master_fds: dict[int, int] = field(default_factory=dict)  # pty index -> fd in the init


def prepare(init_pid: int, ctl: socket.socket, masters: dict[int, int]) -> Prepared:
    """setsid, swap the control socket for a workspace-netns stand-in, hand in pty masters."""
    pairs = in_netns(init_pid, lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET))
    ours, theirs = pairs
    prep = Prepared(init_pid, ctl, stand_in=ours, stand_in_ino=os.fstat(theirs.fileno()).st_ino)
    try:
        with Tracee.seize(init_pid) as t:
            t.syscall(_SYS_setsid)  # EPERM when already a session leader: fine
            prep.saved = _getfd(init_pid, CTL_FD)
            order = sorted(masters)
            socket.send_fds(ctl, [_MAGIC], [theirs.fileno(), *(masters[i] for i in order)])
            got = _recv_fds(t, CTL_FD, 1 + len(order))
            _install(t, got[0], CTL_FD)
            prep.master_fds = dict(zip(order, got[1:]))
    except BaseException:
        ours.close()
        if prep.saved >= 0:
            os.close(prep.saved)
        raise
    finally:
        theirs.close()
    return prep


def undo(prep: Prepared) -> None:
    """Put the real control socket back at fd 3 and close the handed-in masters."""
    try:
        with Tracee.seize(prep.init_pid) as t:
            socket.send_fds(prep.stand_in, [_MAGIC], [prep.saved])
            got = _recv_fds(t, CTL_FD, 1)
            _install(t, got[0], CTL_FD)
            for fd in prep.master_fds.values():
                t.syscall(_SYS_close, fd)
    finally:
        prep.stand_in.close()
        os.close(prep.saved)


def take_masters(init_pid: int, master_fds: dict[int, int]) -> dict[int, int]:
    """In a restored init: copy out the pty masters (pty index -> our fd) and close its copies."""
    out: dict[int, int] = {}
    try:
        for idx, fd in master_fds.items():
            out[idx] = _getfd(init_pid, fd)
            os.set_blocking(out[idx], False)
        if master_fds:
            with Tracee.seize(init_pid) as t:
                for fd in master_fds.values():
                    t.syscall(_SYS_close, fd)
    except BaseException:
        for fd in out.values():
            os.close(fd)
        raise
    return out


def mark_mergeable(pids: list[int]) -> int:
    """``prctl(PR_SET_MEMORY_MERGE, 1)`` in each process (KSM merges their anonymous memory);
    returns how many accepted it."""
    n = 0
    for pid in pids:
        try:
            with Tracee.seize(pid) as t:
                n += t.syscall(_SYS_prctl, _PR_SET_MEMORY_MERGE, 1, 0, 0, 0) == 0
        except Exception:  # noqa: BLE001 - exited meanwhile, or a kernel thread-like oddity
            continue
    return n


def _getfd(pid: int, fd: int) -> int:
    try:
        return getfd_here(pid, fd)
    except OSError as e:
        raise CheckpointError(f"workspace init pid {pid}: {e.strerror}") from None
