"""Terminals of shell sessions: the slave side (/dev/pts/N) lives in the workspace, the master
in the trainer. The child gets pty N in its own devpts, with the template's termios and window
size; the trainer keeps the new master for the child's Shell object. A session leader that
had the terminal as its controlling tty gets it again (setsid + TIOCSCTTY)."""

from __future__ import annotations

import fcntl
import os
import struct
import termios
from types import SimpleNamespace

from ...errors import ForkError

_TIOCGPTN = 0x80045430
_TIOCSPTLCK = 0x40045431
_TIOCSCTTY = 0x540E


def claims(proc, f) -> bool:
    return f.target.startswith("/dev/pts/") and f.target[9:].isdigit()


def _master(ctx, index: int, template_slave: str) -> int:
    """The child's master for pty ``index`` (opened in the child's devpts)."""
    masters = ctx.shared.setdefault("pty_masters", {})
    if index in masters:
        return masters[index]
    spare = []
    try:
        while True:
            m = os.open(f"/proc/{ctx.init_hostpid}/root/dev/pts/ptmx",
                        os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC | os.O_NONBLOCK)
            got = struct.unpack("I", fcntl.ioctl(m, _TIOCGPTN, b"\0" * 4))[0]
            if got == index:
                break
            spare.append(m)
            if got > index + 64:
                raise ForkError(f"cannot get pty {index} in the child's /dev/pts (got {got})")
    finally:
        for s in spare:
            os.close(s)
    fcntl.ioctl(m, _TIOCSPTLCK, struct.pack("i", 0))
    src = os.open(template_slave, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        slave = os.open(f"/proc/{ctx.init_hostpid}/root/dev/pts/{index}", os.O_RDWR | os.O_NOCTTY)
        try:
            termios.tcsetattr(slave, termios.TCSANOW, termios.tcgetattr(src))
            fcntl.ioctl(slave, termios.TIOCSWINSZ, fcntl.ioctl(src, termios.TIOCGWINSZ, b"\0" * 8))
        finally:
            os.close(slave)
    finally:
        os.close(src)
    masters[index] = m
    return m


def fixup(ctx, proc, r, f) -> None:
    index = int(f.target[9:])
    _master(ctx, index, f"/proc/{proc.hostpid}/fd/{f.fd}")
    newfd = r.openat(f.target, (f.flags & os.O_ACCMODE) | os.O_NOCTTY)
    if proc.sid == proc.vpid and index == ctx.ctty(proc):
        r.call("ioctl", newfd, _TIOCSCTTY, 0, ok_errnos=(1,))  # EPERM: it already has one
    r.install(newfd, f.fd)


OPS = SimpleNamespace(kind="pty", claims=claims, fixup=fixup)
