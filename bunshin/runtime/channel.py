"""The trainer's end of a workspace's control socket (protocol in _core/init/proto.h).

One reader thread for every workspace of the trainer (epoll over their sockets: a trainer keeps
thousands, and a thread each would cost thousands of threads) demultiplexes answers (matched by
request id) and exit reports (matched by pid); callers block on their own request only.
"""

from __future__ import annotations

import asyncio
import errno as _errno
import itertools
import logging
import os
import select
import signal
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._core import PROTO
from ..errors import ProtocolError, SpawnError, WorkspaceDied
from ..fork.perprocess import PerProcess

if TYPE_CHECKING:
    from .rootfs.image_config import User

log = logging.getLogger("bunshin.channel")

_HDR = struct.Struct("=IIQII")
_SPAWN = struct.Struct("=IIII")
_USER = struct.Struct("=IIII")
_SPAWNED = struct.Struct("=iiii")
_KILL = struct.Struct("=iiii")
_EXITED = struct.Struct("=ii")
_READY = struct.Struct("=Ii")
_ACK = struct.Struct("=i")
assert _HDR.size == PROTO["SIZEOF_MSG"] and _SPAWN.size == PROTO["SIZEOF_SPAWN"]
assert _USER.size == PROTO["SIZEOF_USER"]

# How long a send may wait for room in the init's receive queue: one that does not read (frozen,
# stopped, or behind on requests whose answers were given up on) would keep it waiting for ever.
SEND_TIMEOUT_S = 30

_STEPS = {
    PROTO["STEP_FORK"]: "fork",
    PROTO["STEP_CHDIR"]: "chdir",
    PROTO["STEP_EXEC"]: "exec",
    PROTO["STEP_FDS"]: "set up descriptors for",
    PROTO["STEP_CTTY"]: "attach the terminal of",
    PROTO["STEP_USER"]: "take the workspace user's ids for",
}


class _Reader:
    """The thread that reads every started channel's socket when it turns readable (one per
    trainer process: a trainer forked since starts its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chans: dict[int, Channel] = {}
        self._ep = select.epoll()
        threading.Thread(target=self._loop, name="bunshin-channels", daemon=True).start()

    def add(self, chan: Channel) -> None:
        with self._lock:
            fd = chan.sock.fileno()
            self._chans[fd] = chan
            self._ep.register(fd, select.EPOLLIN)

    def remove(self, chan: Channel) -> None:
        """After this no read of ``chan`` starts (one under way may finish)."""
        with self._lock:
            fd = chan.sock.fileno()
            if self._chans.get(fd) is chan:
                del self._chans[fd]
                self._ep.unregister(fd)

    def _loop(self) -> None:
        while True:
            # unbounded on purpose: this thread waits for the inits' reports while they live
            for fd, _ev in self._ep.poll():
                with self._lock:
                    chan = self._chans.get(fd)
                if chan is not None:
                    chan._read()


_readers = PerProcess(_Reader)
_ending: set[asyncio.Task] = set()  # unwanted processes being ended (Channel.aend)


def _reader() -> _Reader:
    r = _readers.get()
    assert r is not None  # _Reader() is never None
    return r


@dataclass
class _Pending:
    """A request waiting for its answer: a thread's (``event``) or a coroutine's (``future``,
    completed in its event loop)."""

    event: threading.Event | None = None
    future: asyncio.Future | None = None
    reply: tuple[int, bytes] | None = None

    def done(self) -> None:
        if self.event is not None:
            self.event.set()
        if self.future is not None:
            _complete(self.future, self.reply)


def _complete(fut: asyncio.Future, value: object) -> None:
    """Give ``fut`` its result from any thread (none if it was cancelled meanwhile)."""
    def put() -> None:
        if not fut.done():
            fut.set_result(value)
    try:
        fut.get_loop().call_soon_threadsafe(put)
    except RuntimeError:  # its loop is closed: no one waits any more
        pass


def _spawn_request(argv: Sequence[str], env: Sequence[str], cwd: str, setsid: bool, ctty: bool,
                   track: bool, umask: int, user: User | None) -> tuple[int, bytes]:
    flags = PROTO["SPAWN_TRACK"] if track else 0
    flags |= PROTO["SPAWN_SETSID"] if setsid else 0
    flags |= PROTO["SPAWN_CTTY"] if ctty else 0
    ids = b""
    if user is not None:
        flags |= PROTO["SPAWN_USER"]
        ids = (_USER.pack(user.uid, user.gid, len(user.groups), 0)
               + struct.pack(f"={len(user.groups)}I", *user.groups))
    strings = b"".join(os.fsencode(s) + b"\0" for s in [cwd, *argv, *env])
    return flags, _SPAWN.pack(len(argv), len(env), umask, 0) + ids + strings


class Channel:
    """Requests to one workspace init; thread-safe."""

    def __init__(self, sock: socket.socket, name: str) -> None:
        self._sock = sock
        self._name = name
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_TIMEOUT_S, 0))
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._exits: dict[int, int] = {}
        self._exit_cond = threading.Condition(self._lock)
        self._exit_futures: dict[int, asyncio.Future] = {}
        self._abandoned: set[int] = set()  # requests given up on (cancelled, timed out)
        self._dead: str | None = None
        self._started = False

    # -- start-up ---------------------------------------------------------------------
    @property
    def sock(self) -> socket.socket:
        """The trainer's end of the control socket (a fork clones the init's end; a CRIU dump
        swaps it for a while)."""
        return self._sock

    def wait_ready(self, timeout: float) -> int:
        """Wait for init's READY (or FATAL) and start the reader thread. Returns init's pid."""
        self._sock.settimeout(timeout)
        try:
            data = self._sock.recv(PROTO["MAX_INLINE"] + 4096)
        except TimeoutError:
            raise WorkspaceDied(f"{self._name}: init did not report ready within {timeout}s") from None
        finally:
            self._sock.settimeout(None)
        if not data:
            raise WorkspaceDied(f"{self._name}: init exited during setup (see its init.log)")
        typ, _flags, _id, length, _nfds = _HDR.unpack_from(data)
        payload = data[_HDR.size : _HDR.size + length]
        if typ == PROTO["REP_FATAL"]:
            raise WorkspaceDied(f"{self._name}: setup failed: {payload.decode(errors='replace')}")
        if typ != PROTO["REP_READY"]:
            raise ProtocolError(f"{self._name}: expected READY from init, got message type {typ}")
        version, pid = _READY.unpack_from(payload)
        if version != PROTO["VERSION"]:
            raise ProtocolError(f"{self._name}: init speaks protocol {version}, expected {PROTO['VERSION']}")
        self.start()
        return pid

    @property
    def ready(self) -> bool:
        """Whether init reported ready (or the reader was started) and has not gone since."""
        return self._started and self._dead is None

    def start(self) -> None:
        """Start reading the init's reports (``wait_ready`` does; a CRIU-restored init sends no
        READY)."""
        self._started = True
        _reader().add(self)

    # -- reader -----------------------------------------------------------------------
    def _read(self) -> None:
        """Every message queued now (the reader thread's call, when the socket is readable)."""
        try:
            while True:
                try:
                    data = self._sock.recv(PROTO["MAX_INLINE"] + 4096, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return
                if not data:
                    return self._die("init closed the control socket")
                self._dispatch(data)
        except OSError as e:
            self._die(f"control socket error: {e}")

    def _dispatch(self, data: bytes) -> None:
        typ, _flags, rid, length, _nfds = _HDR.unpack_from(data)
        payload = data[_HDR.size : _HDR.size + length]
        if typ == PROTO["REP_EXITED"]:
            pid, status = _EXITED.unpack_from(payload)
            # kept here until a wait takes it: a waiter cancelled at any point leaves it to the
            # next wait (its reaper); a coroutine's future only wakes it
            with self._lock:
                self._exits[pid] = status
                self._exit_cond.notify_all()
                fut = self._exit_futures.pop(pid, None)
            if fut is not None:
                _complete(fut, True)
            return
        with self._lock:
            p = self._pending.pop(rid, None)
            abandoned = p is None and rid in self._abandoned
            self._abandoned.discard(rid)
        if p is None:
            if not abandoned:
                log.warning("%s: unexpected message type %d id %d", self._name, typ, rid)
            return
        p.reply = (typ, payload)
        p.done()

    def _die(self, why: str) -> None:
        _reader().remove(self)
        with self._lock:
            if self._dead is None:
                self._dead = why
            pending, self._pending = self._pending, {}
            self._abandoned.clear()
            futures, self._exit_futures = self._exit_futures, {}
            self._exit_cond.notify_all()
        for p in pending.values():
            p.done()
        for fut in futures.values():
            _complete(fut, None)

    # -- requests ---------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._dead is None

    def request(self, typ: int, payload: bytes = b"", fds: Sequence[int] = (), flags: int = 0,
                timeout: float | None = 30.0) -> tuple[int, bytes]:
        """Send one request and wait for its answer."""
        pend = _Pending(event=threading.Event())
        rid = self._send(pend, typ, payload, fds, flags)
        assert pend.event is not None
        if not pend.event.wait(timeout):
            self._abandon(rid)
            raise ProtocolError(f"{self._name}: init did not answer request {typ} within {timeout}s")
        if pend.reply is None:
            raise WorkspaceDied(f"{self._name}: {self._dead}")
        return pend.reply

    async def arequest(self, typ: int, payload: bytes = b"", fds: Sequence[int] = (), flags: int = 0,
                       timeout: float | None = 30.0) -> tuple[int, bytes]:
        """:meth:`request` for a coroutine: its event loop runs on while the init answers."""
        return await self._answer(*self._asend(typ, payload, fds, flags), typ, timeout)

    def _asend(self, typ: int, payload: bytes, fds: Sequence[int], flags: int) -> tuple[_Pending, int]:
        """The request sent now (its descriptors are the message's from here on): what
        :meth:`_answer` awaits."""
        pend = _Pending(future=asyncio.get_running_loop().create_future())
        return pend, self._send(pend, typ, payload, fds, flags)

    async def _answer(self, pend: _Pending, rid: int, typ: int, timeout: float | None) -> tuple[int, bytes]:
        assert pend.future is not None
        try:
            reply = await asyncio.wait_for(pend.future, timeout)
        except TimeoutError:
            raise ProtocolError(f"{self._name}: init did not answer request {typ} within {timeout}s") from None
        finally:
            self._abandon(rid)
        if reply is None:
            raise WorkspaceDied(f"{self._name}: {self._dead}")
        return reply

    def _abandon(self, rid: int) -> None:
        """No one waits for request ``rid`` any more; its answer, if it comes, is dropped."""
        with self._lock:
            if self._pending.pop(rid, None) is not None:
                self._abandoned.add(rid)

    def _send(self, pend: _Pending, typ: int, payload: bytes, fds: Sequence[int], flags: int) -> int:
        """Send one request whose answer goes to ``pend`` (a send never blocks for long: the
        init reads as it answers, and SO_SNDTIMEO bounds it)."""
        rid = next(self._ids)
        memfd = -1
        if len(payload) > PROTO["MAX_INLINE"]:
            memfd = os.memfd_create("bunshin-payload", os.MFD_CLOEXEC)
            os.write(memfd, payload)
            fds = [*fds, memfd]
            flags |= PROTO["F_PAYLOAD_FD"]
            wire = _HDR.pack(typ, flags, rid, len(payload), len(fds))
        else:
            wire = _HDR.pack(typ, flags, rid, len(payload), len(fds)) + payload
        with self._lock:
            if self._dead:
                raise WorkspaceDied(f"{self._name}: {self._dead}")
            self._pending[rid] = pend
        try:
            if fds:
                socket.send_fds(self._sock, [wire], list(fds))
            else:
                self._sock.sendall(wire)
        except OSError as e:
            with self._lock:
                self._pending.pop(rid, None)
            if e.errno in (_errno.EAGAIN, _errno.EWOULDBLOCK):  # SO_SNDTIMEO
                raise ProtocolError(f"{self._name}: init did not take request {typ} within "
                                    f"{SEND_TIMEOUT_S}s (its control socket stayed full)") from None
            raise WorkspaceDied(f"{self._name}: cannot reach init: {e}") from None
        finally:
            if memfd >= 0:
                os.close(memfd)
        return rid

    def spawn(self, argv: Sequence[str], env: Sequence[str], cwd: str, fds: Sequence[int], *,
              setsid: bool = True, ctty: bool = False, track: bool = True, umask: int = 0o022,
              user: User | None = None) -> int:
        """Start ``argv`` inside the workspace (as ``user``; None: root); returns its pid in the
        workspace."""
        flags, payload = _spawn_request(argv, env, cwd, setsid, ctty, track, umask, user)
        typ, rep = self.request(PROTO["REQ_SPAWN"], payload, fds, flags)
        return self._spawned(argv, cwd, typ, rep)

    async def aspawn(self, argv: Sequence[str], env: Sequence[str], cwd: str, fds: Sequence[int], *,
                     user: User | None = None) -> int:
        """:meth:`spawn` (a tracked process in a session of its own) for a coroutine."""
        flags, payload = _spawn_request(argv, env, cwd, True, False, True, 0o022, user)
        answer = asyncio.ensure_future(self._answer(*self._asend(PROTO["REQ_SPAWN"], payload, fds, flags),
                                                    PROTO["REQ_SPAWN"], 30.0))
        try:
            typ, rep = await asyncio.shield(answer)
        except asyncio.CancelledError:
            # the init starts it all the same: once it says which pid, that process is ended
            answer.add_done_callback(self._end_unwanted)
            raise
        return self._spawned(argv, cwd, typ, rep)

    def _end_unwanted(self, answer: asyncio.Future) -> None:
        """A process whose spawn was cancelled while the init started it: killed with its
        group, and its exit collected (the channel would keep it otherwise)."""
        if answer.cancelled() or answer.exception() is not None:
            return
        typ, rep = answer.result()
        if typ != PROTO["REP_SPAWNED"]:
            return
        pid, err, _step, _ = _SPAWNED.unpack_from(rep)
        if err or pid <= 0:
            return
        task = asyncio.get_running_loop().create_task(self.aend(pid))
        _ending.add(task)
        task.add_done_callback(_ending.discard)

    async def akill(self, pid: int, sig: int, scope: str = "pid") -> int:
        """:meth:`kill` for a coroutine."""
        code = {"pid": PROTO["KILL_PID"], "pgrp": PROTO["KILL_PGRP"], "all": PROTO["KILL_ALL"]}[scope]
        _typ, rep = await self.arequest(PROTO["REQ_KILL"], _KILL.pack(pid, sig, code, 0))
        return _ACK.unpack_from(rep)[0]

    async def aend(self, pid: int, within: float = 10.0) -> None:
        """Kill a tracked process with its group and collect its exit (``within`` seconds at
        most); a workspace gone meanwhile has nothing left to end."""
        try:
            await self.akill(pid, signal.SIGKILL, "pgrp")
            await asyncio.wait_for(self.await_exit(pid), within)
        except (WorkspaceDied, ProtocolError, TimeoutError):
            pass

    def _spawned(self, argv: Sequence[str], cwd: str, typ: int, rep: bytes) -> int:
        if typ != PROTO["REP_SPAWNED"]:
            raise ProtocolError(f"{self._name}: expected SPAWNED, got message type {typ}")
        pid, err, step, _ = _SPAWNED.unpack_from(rep)
        if err:
            what = _STEPS.get(step, "start")
            target = cwd if step == PROTO["STEP_CHDIR"] else argv[0]
            not_found = err == _errno.ENOENT and step == PROTO["STEP_EXEC"]
            hint = " (not found on PATH inside the workspace)" if not_found else ""
            e = SpawnError(f"{self._name}: cannot {what} {target!r}: {os.strerror(err)}{hint}")
            e.step, e.errno = what, err  # type: ignore[attr-defined]
            raise e
        return pid

    def kill(self, pid: int, sig: int, scope: str = "pid") -> int:
        """Signal a process, its process group, or every process but init. Returns errno."""
        code = {"pid": PROTO["KILL_PID"], "pgrp": PROTO["KILL_PGRP"], "all": PROTO["KILL_ALL"]}[scope]
        _typ, rep = self.request(PROTO["REQ_KILL"], _KILL.pack(pid, sig, code, 0))
        return _ACK.unpack_from(rep)[0]

    def ping(self, timeout: float = 5.0) -> None:
        self.request(PROTO["REQ_PING"], timeout=timeout)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        """Raw wait status of a tracked pid, or None on timeout (None: as long as the process
        runs; the init's death ends the wait too, as the reader thread sees it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while pid not in self._exits:
                if self._dead:
                    raise WorkspaceDied(f"{self._name}: {self._dead}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._exit_cond.wait(left)
            return self._exits.pop(pid)

    async def await_exit(self, pid: int) -> int:
        """Raw wait status of a tracked pid, for a coroutine (cancel it to stop waiting)."""
        with self._lock:
            if pid in self._exits:
                return self._exits.pop(pid)
            if self._dead:
                raise WorkspaceDied(f"{self._name}: {self._dead}")
            fut = self._exit_futures[pid] = asyncio.get_running_loop().create_future()
        try:
            await fut
        finally:
            with self._lock:
                if self._exit_futures.get(pid) is fut:
                    del self._exit_futures[pid]
        with self._lock:
            status = self._exits.pop(pid, None)
        if status is None:
            raise WorkspaceDied(f"{self._name}: {self._dead}")
        return status

    def poll_exit(self, pid: int) -> int | None:
        """Wait status if the pid already exited (consumes it), else None."""
        with self._lock:
            return self._exits.pop(pid, None)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Ask init to kill everything and exit; tolerant of an already dead init."""
        if self._dead is None:
            try:
                self.request(PROTO["REQ_SHUTDOWN"], timeout=timeout)
            except (WorkspaceDied, ProtocolError):
                pass
        self.close()

    def close(self) -> None:
        if self._sock.fileno() >= 0:
            self._die("the control socket was closed")
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
