"""Persistent bash sessions on a pseudo-terminal inside a workspace.

Each :meth:`Shell.run` hands bash the command through a quoted here-document and ``eval``,
so any text (several lines, quotes, a syntax error) is exactly one command; bash's
PROMPT_COMMAND then prints a marker carrying ``$?`` and a per-session nonce, which ends the
call. The terminal is in raw mode without echo, so the output is what the command wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import secrets
import selectors
import signal
import struct
import termios
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ..errors import BunshinError, ShellExited, ToolCallError, WorkspaceClosed
from . import aio
from .capture import Capture
from .result import Result, exit_code_from_status

if TYPE_CHECKING:
    from .body import SessionCopy
    from .workspace import Workspace

__all__ = ["Shell"]

_TIOCGPTPEER = 0x5441
_TIOCGPTN = 0x80045430
_TIOCSPTLCK = 0x40045431


class Shell:
    """A bash session that keeps its state (cwd, variables, functions, history, jobs)."""

    def _init(self, ws: Workspace, master: int, pid: int, nonce: str) -> None:
        self._ws = ws
        self._master = master
        self.pid = pid
        self._nonce = nonce
        self._marker = re.compile(rb"\x1e" + nonce.encode() + rb":(-?\d+)\x1f\n")
        self._lock = threading.Lock()
        self._pending = bytearray()
        self._exited = False
        self._exit_status: int | None = None

    @classmethod
    def start(cls, ws: Workspace, *, env: Mapping[str, str] | None, cwd: str | None) -> Shell:
        """A new session in ``ws`` (what :meth:`Workspace.shell` opens and keeps)."""
        master = ws.open_path("/dev/pts/ptmx", os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
        sh = None
        try:
            fcntl.ioctl(master, _TIOCSPTLCK, struct.pack("i", 0))
            slave = fcntl.ioctl(master, _TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
            try:
                ws.give(slave)  # the trainer opened it: in a sandbox, host root is nobody
                _raw_noecho(slave)
                fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
                envd = {"TERM": "dumb", "PS1": "", "PS2": "", "HISTFILE": "/dev/null"}
                envd.update(env or {})
                envl = ws.tool_env(envd)
                argv = ["bash", "--noprofile", "--norc", "--noediting", "-i"]
                pid = ws.live_channel().spawn(argv, envl, cwd or ws.config.workdir, [slave, slave, slave],
                                            setsid=True, ctty=True, user=ws.config.user)
            finally:
                os.close(slave)
            sh = cls.__new__(cls)
            sh._init(ws, master, pid, secrets.token_hex(8))
            # One line, so that the marker it installs fires exactly once for it.
            setup = (
                "set +H +o history; unset HISTFILE; "
                f"PROMPT_COMMAND='printf \"\\036{sh._nonce}:%d\\037\\n\" $?'; "
                "PS1=''; PS2=''; bind 'set enable-bracketed-paste off' 2>/dev/null; true\n"
            )
            sh._write(setup.encode())
            r = sh._collect(time.monotonic() + 30, 1 << 16)
            if r is None or r[0] != 0:
                sh.close()
                raise BunshinError(f"workspace {ws.id}: bash did not start on a terminal: {r!r}")
            return sh
        except BaseException:
            if sh is None:
                os.close(master)
            raise

    @property
    def id(self) -> str:
        """The session's id: a fork's (or restore's) copy of a session has the same."""
        return self._nonce

    @property
    def master(self) -> int:
        """The trainer's end of the session's terminal (-1 once closed)."""
        return self._master

    def terminal(self) -> tuple[int, int, str]:
        """(pty index, bash pid, session id): what a fork or a CRIU dump needs to give a
        child this session."""
        index = struct.unpack("I", fcntl.ioctl(self._master, _TIOCGPTN, b"\0" * 4))[0]
        return index, self.pid, self._nonce

    @classmethod
    def of_copy(cls, ws: Workspace, copy: SessionCopy) -> Shell:
        """The session ``copy`` (a forked or restored body's) in ``ws``, which owns it."""
        sh = cls.__new__(cls)
        sh._init(ws, copy.master, copy.pid, copy.id)
        return sh

    def rebind(self, ws: Workspace, other: Shell | None) -> int:
        """Belong to ``ws`` from here on (whose body was swapped for a fork's), continuing on
        ``other``'s terminal (this session's copy there), or ended when it has none. Returns
        the previous terminal's master (-1: none), which the caller keeps (a template's) or
        closes."""
        self._ws = ws
        if other is self:
            return -1
        if other is None:
            old, self._master, self._exited = self._master, -1, True
            return old
        with self._lock:
            old, self._master, other._master = self._master, other._master, -1
            # the session may come from another lineage (a template of another workspace):
            # its bash prints that session's marker
            self._nonce, self._marker = other._nonce, other._marker
            self._pending = bytearray()
            self._exited, self._exit_status = False, None
            return old

    # -- I/O ----------------------------------------------------------------------------
    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._master, view):]
            except BlockingIOError:
                self._drain_some(0.01)

    def _drain_some(self, wait: float) -> None:
        # While a large command is being written, bash may print; keep reading so neither
        # side blocks on a full terminal buffer.
        sel = selectors.DefaultSelector()
        sel.register(self._master, selectors.EVENT_READ)
        try:
            if sel.select(wait):
                try:
                    self._pending += os.read(self._master, 1 << 16)
                except OSError:
                    pass
        finally:
            sel.close()

    def _collect(self, deadline: float, cap: int) -> tuple[int, Capture] | None:
        """Read until the marker; returns (exit status, output) or None at the deadline."""
        out = Capture(cap)
        buf = self._pending
        self._pending = bytearray()
        sel = selectors.DefaultSelector()
        sel.register(self._master, selectors.EVENT_READ)
        try:
            while True:
                m = self._marker.search(buf)
                if m:
                    out.feed(bytes(buf[: m.start()]))
                    self._pending = bytearray(buf[m.end() :])
                    return int(m.group(1)), out
                # Keep a tail that could be the start of a marker split across reads.
                keep = 64
                if len(buf) > keep:
                    out.feed(bytes(buf[:-keep]))
                    del buf[:-keep]
                left = deadline - time.monotonic()
                if left <= 0:
                    self._pending = buf
                    return None
                if not sel.select(min(left, 0.05)):
                    # bash may be gone while a background job still holds the terminal open,
                    # so the terminal alone cannot tell us it exited.
                    if self._exit_status is None:
                        self._exit_status = self._ws.live_channel().poll_exit(self.pid)
                    if self._exit_status is not None:
                        out.feed(bytes(buf))
                        self._exited = True
                        raise _Eof(out)
                    continue
                try:
                    data = os.read(self._master, 1 << 16)
                except OSError:  # EIO: every slave closed, bash is gone
                    data = b""
                if not data:
                    out.feed(bytes(buf))
                    self._exited = True
                    raise _Eof(out)
                buf += data
        finally:
            sel.close()

    # -- public -------------------------------------------------------------------------
    def run(self, cmd: str, *, timeout: float | None = 30.0, max_output: int | None = None) -> Result:
        """Run ``cmd`` in the session. stderr is merged into stdout, as on a terminal.

        On timeout the foreground job gets SIGINT (then SIGKILL) and the session stays usable.
        """
        if not isinstance(cmd, str):
            raise ToolCallError(f"cmd must be a str, got {type(cmd).__name__}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ToolCallError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        cap = self._ws.config.max_output if max_output is None else max_output
        with self._lock:
            if self._exited:
                raise ShellExited(f"shell {self.pid} in workspace {self._ws.id} has exited; open a new one "
                                  "with ws.shell()")
            if self._ws.closed:
                raise WorkspaceClosed(f"workspace {self._ws.id} is closed")
            delim = f"__BUNSHIN_EOF_{self._nonce}__"
            text = cmd if cmd.endswith("\n") else cmd + "\n"
            wrapped = (f"IFS= read -r -d '' __bx_cmd <<'{delim}'; history -s -- \"${{__bx_cmd%$'\\n'}}\"; "
                       f"eval \"$__bx_cmd\"\n{text}{delim}\n")
            start = time.monotonic()
            deadline = start + timeout if timeout is not None else float("inf")
            try:
                self._write(wrapped.encode())
                r = self._collect(deadline, cap)
                timed_out = r is None
                if r is None:
                    r = self._interrupt(cap)
            except _Eof as eof:
                st = self._exit_status
                if st is None:
                    st = self._exit_status = self._ws.live_channel().wait_exit(self.pid, 5)
                code, sig = exit_code_from_status(st) if st is not None else (0, None)
                return Result(bytes(eof.out.buf), b"", code, time.monotonic() - start,
                              truncated=bool(eof.out.dropped), signal=sig)
            code, out = r
            return Result(bytes(out.buf), b"", code, time.monotonic() - start, timed_out=timed_out,
                          truncated=bool(out.dropped))

    async def arun(self, cmd: str, *, timeout: float | None = 30.0,
                   max_output: int | None = None) -> Result:
        """:meth:`run` for asyncio. Cancelling the awaiting task interrupts the command as its
        timeout would (^C, then SIGKILL of the foreground job); the session stays usable."""
        call = asyncio.ensure_future(aio.in_thread(lambda: self.run(cmd, timeout=timeout,
                                                                     max_output=max_output)))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            if not call.done():
                await self._abandon(call)
            raise

    async def _abandon(self, call: asyncio.Future) -> None:
        """End the command ``call`` runs, and wait (boundedly) for the session to be ready."""
        with contextlib.suppress(OSError):
            os.write(self._master, b"\x03")
        for wait, kill in ((2, True), (5, False)):
            done, _ = await asyncio.wait([call], timeout=wait)
            if done:
                break
            if kill:
                with contextlib.suppress(OSError):
                    pgrp = os.tcgetpgrp(self._master)
                    if pgrp > 0 and pgrp != os.getpgrp():  # never killpg(0): our own group
                        os.killpg(pgrp, signal.SIGKILL)
        if call.done() and not call.cancelled():
            call.exception()  # retrieved: the caller was cancelled and wants no result

    def send(self, text: str, *, until: Sequence[str] = (),
             timeout: float | None = 30.0) -> tuple[bytes, str | int | None]:
        """Type ``text`` on the session's terminal, as a user would: the program in the
        foreground reads it (an interactive one that :meth:`run` cannot drive, such as a REPL
        or a debugger), else bash does. Then read until one of ``until`` appears (returns
        it), or bash is back at its prompt (returns the exit status of its last command), or
        ``timeout`` passes (returns None; nothing is interrupted: ``send("\\x03")`` is ^C).
        The bytes are what came before that; after a match, what follows stays for the next
        call. A command that was left before bash's prompt came back must be waited for with
        ``send("")`` before :meth:`run` is used again, as its prompt would end that run."""
        if not isinstance(text, str):
            raise ToolCallError(f"text must be a str, got {type(text).__name__}")
        pats = [u.encode() for u in until]
        with self._lock:
            if self._exited:
                raise ShellExited(f"shell {self.pid} in workspace {self._ws.id} has exited")
            if self._ws.closed:
                raise WorkspaceClosed(f"workspace {self._ws.id} is closed")
            self._write(text.encode())
            deadline = time.monotonic() + timeout if timeout is not None else float("inf")
            buf, self._pending = self._pending, bytearray()
            sel = selectors.DefaultSelector()
            sel.register(self._master, selectors.EVENT_READ)
            try:
                while True:
                    hits: list[tuple[int, int, str | int]] = []
                    m = self._marker.search(buf)
                    if m:
                        hits.append((m.start(), m.end(), int(m.group(1))))
                    for p in pats:
                        i = buf.find(p)
                        if i >= 0:
                            hits.append((i, i + len(p), p.decode()))
                    if hits:
                        start, end, what = min(hits, key=lambda h: h[0])
                        self._pending = bytearray(buf[end:])
                        return bytes(buf[:start]), what
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return bytes(buf), None
                    if not sel.select(min(left, 0.05)):
                        continue
                    try:
                        data = os.read(self._master, 1 << 16)
                    except OSError:
                        data = b""
                    if not data:
                        self._exited = True
                        raise ShellExited(f"shell {self.pid} in workspace {self._ws.id} exited; it wrote "
                                          f"{bytes(buf[-300:])!r}")
                    buf += data
            finally:
                sel.close()

    def _interrupt(self, cap: int) -> tuple[int, Capture]:
        os.write(self._master, b"\x03")  # ^C: SIGINT to the foreground job, as a user would
        r = self._collect(time.monotonic() + 2, cap)
        if r is not None:
            return r
        try:
            pgrp = os.tcgetpgrp(self._master)  # a host pid: we are in the parent namespace
        except OSError:
            pgrp = 0
        # 0 means no foreground job; never let that become killpg(0), our own group.
        if pgrp > 0 and pgrp != os.getpgrp():
            try:
                os.killpg(pgrp, signal.SIGKILL)
            except OSError:
                pass
        r = self._collect(time.monotonic() + 5, cap)
        if r is None:
            raise BunshinError(f"shell {self.pid} in workspace {self._ws.id} is stuck after SIGKILL of "
                               "its foreground job")
        return r

    @property
    def alive(self) -> bool:
        return not self._exited and not self._ws.closed

    def close(self) -> None:
        """End the session (SIGHUP then SIGKILL to its process group)."""
        if not self._exited and not self._ws.closed:
            try:
                self._ws.live_channel().kill(self.pid, signal.SIGKILL, "pgrp")
            except BunshinError:
                pass
        self._exited = True
        self.detach()
        self._ws.forget_shell(self)

    def detach(self) -> None:
        """Close the terminal's master (its workspace is closing: its processes go with it)."""
        if self._master >= 0:
            os.close(self._master)
            self._master = -1
        self._exited = True

    def __enter__(self) -> Shell:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Eof(Exception):
    def __init__(self, out: Capture) -> None:
        self.out = out


def _raw_noecho(fd: int) -> None:
    attrs = termios.tcgetattr(fd)
    attrs[0] &= ~(termios.ICRNL | termios.IXON)  # iflag
    attrs[1] &= ~termios.OPOST  # oflag: no \n -> \r\n
    attrs[3] &= ~(termios.ECHO | termios.ECHONL | termios.ICANON | termios.IEXTEN)  # lflag, ISIG kept
    attrs[6][termios.VMIN] = 1
    attrs[6][termios.VTIME] = 0
    termios.tcsetattr(fd, termios.TCSANOW, attrs)
