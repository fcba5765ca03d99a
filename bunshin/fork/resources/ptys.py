"""Terminals. A shell session's pty has its slave (/dev/pts/N) in the workspace and its master
in the trainer: the child gets pty N in its own devpts, with the template's termios and window
size, and the trainer keeps the new master for the child's Shell object. A pty whose master is
inside the workspace (script, tmux, expect, a REPL driver) is recreated the same way, its
master opened inside the child by whichever clone needs the pty first and fetched by the
others (pidfd_getfd). A session leader that had the terminal as its controlling tty gets it
again (setsid + TIOCSCTTY). Bytes buffered in a pty are not carried."""

from __future__ import annotations

import fcntl
import os
import struct
import termios
from types import SimpleNamespace

from ...errors import ForkError
from . import sharing

_TIOCGPTN = 0x80045430
_TIOCSPTLCK = 0x40045431
_TIOCSCTTY = 0x540E


_MASTERS = ("/dev/ptmx", "/dev/pts/ptmx")


def claims(proc, f) -> bool:
    return f.target in _MASTERS or (f.target.startswith("/dev/pts/") and f.target[9:].isdigit())


def _held_masters(plans) -> set[int]:
    """Indexes of the ptys whose master a template process holds."""
    return {int(sharing.fdinfo(p.hostpid, f.fd)["tty-index"])
            for p in plans if not p.is_init for f in p.fds if f.target in _MASTERS}


def _inner_indexes(ctx) -> set[int]:
    if "inner-ptys" not in ctx.shared:
        ctx.shared["inner-ptys"] = _held_masters(ctx.plans.values())
    return ctx.shared["inner-ptys"]


def _open_index(index: int, open_master, index_of, close) -> int:
    """A master for pty ``index`` in a devpts instance: open ptmx until the kernel hands out
    that number (it takes the lowest free one), closing the others."""
    spare = []
    try:
        while True:
            m = open_master()
            got = index_of(m)
            if got == index:
                return m
            spare.append(m)
            if got > index + 64:
                raise ForkError(f"cannot get pty {index} in the child's /dev/pts (got {got})")
    finally:
        for fd in spare:
            close(fd)


def _copy_termios(src_path: str, dst_path: str) -> None:
    src = os.open(src_path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        dst = os.open(dst_path, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
        try:
            termios.tcsetattr(dst, termios.TCSANOW, termios.tcgetattr(src))
            fcntl.ioctl(dst, termios.TIOCSWINSZ, fcntl.ioctl(src, termios.TIOCGWINSZ, b"\0" * 8))
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _inner_master(ctx, proc, r, index: int) -> tuple[int, int]:
    """(vpid, fd) of the child's master of inner pty ``index``, made in this clone if new."""
    made = ctx.shared.setdefault("inner-masters", {})
    if index in made:
        return made[index]

    def open_master() -> int:
        return r.openat("/dev/pts/ptmx", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)

    def index_of(fd: int) -> int:
        addr = r.put(bytes(4))
        r.call("ioctl", fd, _TIOCGPTN, addr)
        return struct.unpack("I", r.t.read(addr, 4))[0]

    fd = _open_index(index, open_master, index_of, lambda fd: r.call("close", fd))
    r.call("ioctl", fd, _TIOCSPTLCK, r.put(struct.pack("i", 0)))
    tpl_init = next(p.hostpid for p in ctx.plans.values() if p.is_init)
    _copy_termios(f"/proc/{tpl_init}/root/dev/pts/{index}", f"/proc/{ctx.init_hostpid}/root/dev/pts/{index}")
    made[index] = (proc.vpid, fd)
    ctx.shared.setdefault("close_later", []).append((r.t, fd))  # a spare until its holder takes it
    return made[index]


def open_master(child_init: int, index: int, template_slave: str) -> int:
    """A master, in the trainer, for pty ``index`` of the devpts of the child whose init is
    ``child_init``, with the termios and window size of ``template_slave``."""
    m = _open_index(index,
                    lambda: os.open(f"/proc/{child_init}/root/dev/pts/ptmx",
                                    os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC | os.O_NONBLOCK),
                    lambda fd: struct.unpack("I", fcntl.ioctl(fd, _TIOCGPTN, b"\0" * 4))[0],
                    os.close)
    try:
        fcntl.ioctl(m, _TIOCSPTLCK, struct.pack("i", 0))
        _copy_termios(template_slave, f"/proc/{child_init}/root/dev/pts/{index}")
    except BaseException:
        os.close(m)
        raise
    return m


def trainer_indexes(plans) -> set[int]:
    """The ptys whose slave a template process holds and whose master is the trainer's (a
    shell session's): the ones whose child masters :func:`open_master` can make ahead."""
    slaves = {int(f.target[9:]) for p in plans if not p.is_init for f in p.fds
              if f.handler is OPS and f.target not in _MASTERS}
    return slaves - _held_masters(plans)


def _master(ctx, index: int, template_slave: str) -> int:
    """The child's master for pty ``index`` (opened in the child's devpts, or made ahead with
    the child's init: earlyinit.py)."""
    masters = ctx.shared.setdefault("pty_masters", {})
    if index not in masters:
        masters[index] = open_master(ctx.init_hostpid, index, template_slave)
    return masters[index]


def fixup(ctx, proc, r, f) -> None:
    if f.target in _MASTERS:
        index = int(sharing.fdinfo(proc.hostpid, f.fd)["tty-index"])
        r.install(sharing.grab(r, _inner_master(ctx, proc, r, index)), f)
        return
    index = int(f.target[9:])
    if index in _inner_indexes(ctx):
        _inner_master(ctx, proc, r, index)  # the slave's master must exist before it opens
    else:
        _master(ctx, index, f"/proc/{proc.hostpid}/fd/{f.fd}")
    newfd = r.queue_openat(f.target, (f.flags & os.O_ACCMODE) | os.O_NOCTTY)
    if proc.sid == proc.vpid and index == proc.ctty:
        r.queue("ioctl", newfd, _TIOCSCTTY, 0, ok_errnos=(1,))  # EPERM: it already has one
    r.install(newfd, f)


OPS = SimpleNamespace(kind="pty", claims=claims, fixup=fixup)
