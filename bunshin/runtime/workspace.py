"""A workspace: namespaces + overlay root + cgroup + an init that launches tool calls.

A :class:`Workspace` is a handle on its settings (:class:`WorkspaceConfig`), its live parts
(:class:`~bunshin.runtime.body.Body`) and its shell sessions. Forks and snapshots are made by
bunshin/fork/ from the body; a rollback swaps the handle's body for a fork's.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import re
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from .. import _core, config, criu, sandbox
from ..config import isolation as _default_isolation
from .._core import _syscalls
from ..errors import (
    BunshinError,
    ForkError,
    LimitError,
    PermissionDenied,
    RootfsError,
    SpawnError,
    ToolCallError,
    WorkspaceClosed,
    WorkspaceDied,
)
from ..fork import engine, slots
from ..fork.plan import proc_status
from ..fork.template import check_n, freeze_source, snapshot_body
from ..speculate.block import Speculation
from . import rootfs as _rootfs
from .body import Body, SessionCopy, allocate
from .capture import DEFAULT_MAX_OUTPUT, Capture, pump
from .cgroup.limits import Limits
from .channel import Channel
from .result import Result, exit_code_from_status
from .rootfs.image_config import ImageConfig, resolve_user
from .shell import Shell
from . import aio, headroom, template, trainer
from . import quota as _quota
from . import userns as _userns
from .template import Template
from .workspace_config import WorkspaceConfig

if TYPE_CHECKING:
    from .cgroup.base import Cgroup
    from .rootfs.model import Rootfs

__all__ = ["ProcessInfo", "Workspace"]

log = logging.getLogger("bunshin.workspace")

_NS_FLAGS = (
    0x00020000  # CLONE_NEWNS
    | 0x20000000  # CLONE_NEWPID
    | 0x40000000  # CLONE_NEWNET
    | 0x08000000  # CLONE_NEWIPC
    | 0x04000000  # CLONE_NEWUTS
)
_O_PATH = getattr(os, "O_PATH", 0o10000000)
log_fork = logging.getLogger("bunshin.fork")
_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "xterm",
}

_live: weakref.WeakSet[Workspace] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """What the trainer left open goes with it: its workspaces, then its templates (a source
    or template with live children is kept until they close)."""
    for ws in list(_live):
        try:
            ws.close()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass
    template.close_all()


@dataclass(frozen=True)
class ProcessInfo:
    """A process inside a workspace, as seen from inside (pids are the workspace's)."""

    pid: int
    ppid: int
    state: str
    cmdline: list[str]
    rss_bytes: int


def _check_env(env: Mapping[str, str] | None, what: str) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise ToolCallError(f"{what} must be a mapping of str to str, got {type(env).__name__}")
    for k, v in env.items():
        if not isinstance(k, str) or not isinstance(v, str) or not k or "=" in k or "\0" in k + v:
            raise ToolCallError(f"{what}: bad entry {k!r}={v!r}; names are non-empty str without '=' "
                                "and values are str")
    return dict(env)


def _check_abs(path: str, what: str) -> str:
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise ToolCallError(f"{what} must be an absolute path inside the workspace, got {path!r}")
    return path


def _check_argv(argv: Sequence[str]) -> None:
    if isinstance(argv, (str, bytes)) or not argv or not all(isinstance(a, str) for a in argv):
        raise ToolCallError(f"argv must be a non-empty sequence of str, got {argv!r}")


def _check_timeout(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ToolCallError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return float(timeout)


def _check_max_output(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ToolCallError(f"max_output must be a non-negative int (bytes per stream), got {n!r}")
    return n


class _ToolCall:
    """One tool call of :meth:`Workspace.exec` or :meth:`Workspace.aexec`: its pipes, their
    captures, and the Result made of them."""

    def __init__(self, ws: Workspace, chan: Channel, argv: list[str], env: list[str], cwd: str,
                 timeout: float | None, cap: int, in_fd: int) -> None:
        self.ws, self.chan, self.argv, self.env, self.cwd, self.timeout = ws, chan, argv, env, cwd, timeout
        self.in_fd = in_fd
        made: list[int] = []
        try:
            made += os.pipe2(os.O_CLOEXEC)
            made += os.pipe2(os.O_CLOEXEC)
        except OSError:
            for fd in [in_fd, *made]:
                os.close(fd)
            raise
        self.out_r, self.out_w, self.err_r, self.err_w = made
        self.caps = {self.out_r: Capture(cap), self.err_r: Capture(cap)}
        self.reading = False  # the read ends handed to pump() or aio.collect(), which close them
        self.oom_before = ws._oom_kills()
        self.start = time.monotonic()

    def child_fds(self) -> list[int]:
        return [self.in_fd, self.out_w, self.err_w]

    def spawn(self, pid: int) -> int:
        """The call's process started: the child's ends of its pipes are its alone."""
        self._close_child_ends()
        return pid

    def _close_child_ends(self) -> None:
        for name in ("in_fd", "out_w", "err_w"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    def not_found(self, e: SpawnError) -> Result:
        """A command not found is exit code 127, as in a shell; another SpawnError is raised."""
        if getattr(e, "step", "") == "exec" and getattr(e, "errno", 0) == errno.ENOENT:
            return Result(b"", f"bunshin: {self.argv[0]}: command not found\n".encode(), 127,
                          time.monotonic() - self.start)
        raise e

    def result(self, status: int, timed_out: bool) -> Result:
        code, sig = exit_code_from_status(status)
        out, err = self.caps[self.out_r], self.caps[self.err_r]
        return Result(bytes(out.buf), bytes(err.buf), code, time.monotonic() - self.start,
                      timed_out=timed_out, truncated=bool(out.dropped or err.dropped),
                      signal=sig, oom_killed=self.ws._oom_kills() > self.oom_before)

    def read_ends(self) -> dict[int, Capture]:
        """The read ends with their captures, for a reader that closes them."""
        self.reading = True
        return self.caps

    def end(self) -> None:
        """Close what is still open."""
        self._close_child_ends()
        if not self.reading:
            for fd in self.caps:
                os.close(fd)
        with self.ws._shell_lock:
            self.ws._calls -= 1


class Workspace:
    """A live, isolated Linux workspace that tool calls run in.

    Create one with :meth:`create`; use it as a context manager or call :meth:`close`.
    All methods are thread-safe.
    """

    _config: WorkspaceConfig
    _body: Body
    _shells: list[Shell]
    _shell_lock: threading.Lock  # guards _shells and _calls
    _calls: int  # exec() calls in flight: their pipes lead to us, a fork cannot carry them
    _spares: slots.Spares | None  # host-side parts of the next fork (slots.py)
    _host_writes: int

    # -- creation -----------------------------------------------------------------------
    def __init__(self) -> None:  # use Workspace.create()
        self._closed = True
        self._close_lock = threading.Lock()

    @classmethod
    def from_body(cls, config: WorkspaceConfig, body: Body,
                  sessions: Sequence[SessionCopy] = ()) -> Workspace:
        """The handle on a body made elsewhere (a fork's child, a CRIU restore), with ``config``
        and a :class:`Shell` for each of ``sessions``, in their order. It owns the body (and
        the sessions' terminals) from here on."""
        self = cls()
        self._closed = False
        self._config = config
        self._body = body
        self._shell_lock = threading.Lock()
        self._calls = 0
        self._spares = None
        self._host_writes = 0
        self._shells = [Shell.of_copy(self, s) for s in sessions]
        _live.add(self)
        return self

    @classmethod
    def create(
        cls,
        rootfs: str | os.PathLike | None = None,
        *,
        memory_limit: int | str | None = None,
        pids_limit: int | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        hostname: str | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        ready_timeout: float = 30.0,
        isolation: str | None = None,
        disk_limit: int | str | None = None,
    ) -> Workspace:
        """Start a workspace.

        ``rootfs``: None for the embedded default (a read-only view of the host's system
        with private, empty /tmp, /root, /home, /run), a directory, a tar archive, an OCI
        image (layout directory, OCI archive or ``docker save`` archive), or ``"debian:SUITE"``.
        ``memory_limit`` (bytes or "512M"/"2G") and ``pids_limit`` bound the whole workspace.
        ``env``, ``workdir`` and ``user`` are the defaults for every tool call, over an image's
        own ``Env``, ``WorkingDir`` and ``User`` (:mod:`~bunshin.runtime.rootfs.image_config`;
        otherwise ``/`` and root). ``user`` is ``name``, ``uid``, ``name:group`` or ``uid:gid``,
        looked up in the workspace's own /etc/passwd and /etc/group (``UnknownUser`` if it is not
        there); its home is ``HOME`` unless ``env`` or the image sets it. An image's
        ``Entrypoint`` + ``Cmd`` is not started: it is :attr:`image_cmd`.
        ``isolation``: ``"sandbox"`` runs it in a user namespace of its own, whose root has no
        power over the host (docs/design.md, "Isolation"), with container-runtime defaults
        (seccomp filter, capability bounding set, masked and read-only /proc and /sys:
        :mod:`bunshin.sandbox`); ``"trusted"``: its root is the host's, for code that needs
        host powers. None: ``BUNSHIN_ISOLATION`` (default ``"sandbox"``). Its forks have the
        same.
        ``disk_limit`` (bytes or "4G"; 0: none; None: ``BUNSHIN_DISK_LIMIT``, default 4G)
        bounds what it writes to its file system: past it a write fails with ``EDQUOT``. Each
        fork may write as much again, counted from the fork (docs/design.md, "Disk quotas").
        """
        if os.geteuid() != 0:
            raise PermissionDenied("bunshin needs root (namespaces, mounts, cgroups); run as root")
        env = _check_env(env, "env")
        if workdir is not None:
            workdir = _check_abs(workdir, "workdir")
        if user is not None and not isinstance(user, str):
            raise BunshinError(f"user must be a str ('name', 'uid', 'name:group', 'uid:gid'), got {user!r}")
        if hostname is not None and (not isinstance(hostname, str) or not _HOSTNAME.match(hostname)):
            raise BunshinError(f"hostname must be a valid host name (letters, digits, '-'; ≤ 63), got {hostname!r}")
        max_output = _check_max_output(max_output)
        isolation = sandbox.check_isolation(
            _userns.check(_default_isolation() if isolation is None else isolation))
        if pids_limit is not None and (isinstance(pids_limit, bool) or not isinstance(pids_limit, int)
                                       or pids_limit < 1):
            raise LimitError("pids_limit must be an int ≥ 1 (processes + threads in the workspace), "
                             f"got {pids_limit!r}")
        limits = Limits.parse(memory_limit, pids_limit)
        disk_limit = _quota.parse_disk(disk_limit)
        rfs = _rootfs.resolve(rootfs)
        a = allocate(limits, rootfs=rfs.source, lowers=[str(p) for p in rfs.lowers],
                     disk_limit=disk_limit)
        body = Body(a.dir, a.cgroup, a.meta, rfs)
        image = rfs.image or ImageConfig()
        config = WorkspaceConfig(env={**DEFAULT_ENV, **dict(image.env), **env},
                                 workdir=workdir or image.workdir or "/", max_output=max_output,
                                 limits=limits, hostname=hostname or f"bunshin-{body.id[:6]}",
                                 isolation=isolation, disk_limit=disk_limit, image_cmd=image.command)
        self = cls.from_body(config, body)
        try:
            rfs.prepare_upper(body.dir.upper)
            if isolation == "sandbox":
                _userns.shift_tree(body.dir.upper)
            self._start_init(ready_timeout)
            self._take_user(user if user is not None else image.user,
                            "user=" if user is not None else f"the User of image {rfs.source!r}",
                            home_set="HOME" in env or any(k == "HOME" for k, _ in image.env))
        except BaseException:
            self._closed = True
            _live.discard(self)
            self._teardown()
            raise
        log.info("workspace %s up (init host pid %d, rootfs %s)", self.id, self.init_pid, rfs.source)
        return self

    def _start_init(self, ready_timeout: float) -> None:
        b = self._body
        d = b.dir
        sandbox = self._config.isolation == "sandbox"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        logfd = os.open(d.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        argv = ["bunshin-init", "--hostname", self._config.hostname]
        if sandbox:
            argv += ["--cgroupns", "1"]
        else:
            argv += ["--root", str(d.root), "--lower", ":".join(str(p) for p in b.rootfs.lowers),
                     "--upper", str(d.upper), "--work", str(d.work)]
            for f in b.cgroup.procs_files():
                argv += ["--cgroup", f]
        flags = _NS_FLAGS | (_userns.CLONE_NEWUSER if sandbox else 0)
        try:
            pid, pidfd = _syscalls.clone_exec(flags, str(_core.init_path()), argv,
                                              ["PATH=" + DEFAULT_ENV["PATH"], *self._sandbox_env()],
                                              (null, null, logfd),
                                              theirs.fileno())
        except OSError as e:
            ours.close()
            theirs.close()
            if e.errno == errno.EAGAIN:
                raise headroom.no_process("the workspace init") from None
            raise BunshinError(f"cannot start the workspace init: {e} (see `bunshin doctor`)") from None
        finally:
            os.close(logfd)
            os.close(null)
        b.init_pid, b.pidfd = pid, pidfd
        b.channel = Channel(ours, f"workspace {self.id}")
        try:
            if sandbox:
                self._enter_sandbox(ours, theirs, ready_timeout)
            else:
                theirs.close()
                b.channel.wait_ready(ready_timeout)
        except WorkspaceDied as e:
            msg = str(e)
            if "mount overlay" in msg:
                raise RootfsError(f"{msg}\nthe rootfs {b.rootfs.source!r} cannot be used as an overlay "
                                  "lower layer") from None
            raise
        finally:
            if theirs.fileno() >= 0:
                theirs.close()
        trainer.give_own_limits(pid)  # set up, and not yet asked to start anything
        b.meta.init_pid = pid
        d.write_meta(b.meta)
        b.open_root()
        self._config = replace(self._config,
                               run_shell="/bin/bash" if self._exists("/bin/bash") else "/bin/sh")

    def _take_user(self, spec: str | None, source: str, home_set: bool) -> None:
        """Tool calls run as ``spec``, resolved in this workspace's own /etc/passwd and /etc/group."""
        if spec is None:
            return
        files: list[bytes | None] = []
        for path in ("/etc/passwd", "/etc/group"):
            try:
                files.append(self.read_file(path, max_bytes=16 << 20))
            except ToolCallError:
                files.append(None)
        who = resolve_user(spec, files[0], files[1], source)
        env_ = dict(self._config.env)
        if who.home and not home_set:
            env_["HOME"] = who.home
        self._config = replace(self._config, user=None if (who.uid, who.gid, who.groups) == (0, 0, ()) else who,
                               env=env_)

    def _sandbox_env(self) -> tuple[str, ...]:
        return sandbox.init_env() if self._config.isolation == "sandbox" else ()

    def _enter_sandbox(self, ours: socket.socket, theirs: socket.socket, ready_timeout: float) -> None:
        """The init just cloned into a new user namespace waits for its maps (clone_exec.c):
        it is put into its cgroup (whose files are the host's, out of its reach), its user
        namespace gets the shifted map, and once it reports ready in its namespaces it is
        moved into its root, built here as a fork's is (mounted by the trainer on the
        rootfs's idmapped layers), by the same request a fork's init gets (REROOT)."""
        b = self._body
        assert b.channel is not None  # made with the body, before the init runs
        b.cgroup.add(b.init_pid)
        b.userns = _userns.UserNs.of_new_init(b.init_pid, b.rootfs.lowers)
        b.userns.acquire()
        ours.send(b"g")
        b.channel.wait_ready(ready_timeout)
        try:
            mfd = engine.overlay_fd(b.rootfs.lowers, b.dir.upper, b.dir.work, b.userns)
        except ForkError as e:
            raise RootfsError(f"{e}\nthe rootfs {b.rootfs.source!r} cannot be used as an overlay "
                              "lower layer, or this kernel's overlayfs cannot stack on the "
                              "idmapped views of it a sandbox's root is built on: use "
                              "isolation='trusted' (BUNSHIN_ISOLATION=trusted) here") from None
        try:
            typ, payload = b.channel.request(_core.PROTO["REQ_REROOT"], self._config.hostname.encode(),
                                             fds=[mfd, theirs.fileno()], timeout=ready_timeout)
        finally:
            os.close(mfd)
        if typ != _core.PROTO["REP_READY"]:
            raise WorkspaceDied(f"workspace {self.id}: setup failed: {payload.decode(errors='replace')}")

    def _exists(self, path: str) -> bool:
        try:
            os.close(self.open_path(path, _O_PATH))
            return True
        except ToolCallError:
            return False

    # -- what it is made of -------------------------------------------------------------
    @property
    def id(self) -> str:
        return self._body.id

    @property
    def init_pid(self) -> int:
        """The host pid of the workspace's init."""
        return self._body.init_pid

    @property
    def rootfs(self) -> Rootfs:
        """The root file system the workspace runs (for a fork: its template's layers)."""
        return self._body.rootfs

    @property
    def image_cmd(self) -> tuple[str, ...]:
        """The image's ``Entrypoint`` + ``Cmd`` (empty for a root that is not an image, or an
        image that names none): what ``docker run IMAGE`` would start, e.g. as
        ``ws.spawn(ws.image_cmd)``."""
        return self._config.image_cmd

    @property
    def config(self) -> WorkspaceConfig:
        """Its settings, carried by its forks and restores. The limits are its cgroup's at
        this moment: ``ws.cgroup.set_limits(...)`` changes them for the next fork too."""
        cfg, limits = self._config, self._body.cgroup.limits
        if cfg.limits != limits:
            cfg = self._config = replace(cfg, limits=limits)
        return cfg

    @property
    def body(self) -> Body:
        """Its live parts (init, channel, cgroup, directory, template); for bunshin's own
        modules (fork, criu, speculate). A rollback replaces it."""
        return self._body

    @property
    def host_writes(self) -> int:
        """How many times the trainer opened a file in it for writing (``write_file``,
        ``open_path``): what its cgroup's CPU time does not show."""
        return self._host_writes

    @property
    def shells(self) -> list[Shell]:
        """Its open shell sessions, in the order they were opened. A fork's are the copies of
        its source's, in the source's order; each copy has its original's :attr:`Shell.id`."""
        with self._shell_lock:
            return list(self._shells)

    # -- lifetime -----------------------------------------------------------------------
    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"init={getattr(self, 'init_pid', '?')}"
        return f"<Workspace {getattr(self, 'id', '?')} {state}>"

    @property
    def closed(self) -> bool:
        return self._closed

    def live_channel(self) -> Channel:
        """The control channel to its init; :class:`WorkspaceClosed` once it is closed."""
        if self._closed:
            raise WorkspaceClosed(f"workspace {getattr(self, 'id', '?')} is closed; create or fork a new one")
        assert self._body.channel is not None
        return self._body.channel

    def close(self) -> None:
        """Kill every process of the workspace and remove its cgroup, mounts and files. While
        children of its forks live it is frozen instead (their pid namespaces are below its
        own), and goes with the last of them."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            _live.discard(self)
            self._teardown()

    def _teardown(self) -> None:
        spares, self._spares = self._spares, None
        if spares is not None:
            spares.close_slots()
        for sh in list(self._shells):
            sh.detach()
        self._body.close()

    @contextlib.contextmanager
    def steady(self, why: str) -> Iterator[None]:
        """While inside: the workspace is open, no tool call runs (else ForkError: ``why``
        they must end first) and no fork, snapshot, rollback or close starts. For reading its
        body as a whole (a snapshot, a CRIU dump)."""
        with self._close_lock:
            self.live_channel()
            if self._calls:
                raise ForkError(f"workspace {self.id}: {self._calls} tool call(s) running; {why}")
            yield

    def terminals(self) -> list[tuple[tuple[int, int, str], int]]:
        """((pty index, bash pid, session id), master fd) of each live shell session: what a
        fork or a CRIU dump copies of them."""
        shells = [sh for sh in self.shells if sh.alive]
        return [(sh.terminal(), sh.master) for sh in shells]

    # -- tool calls ---------------------------------------------------------------------
    def tool_env(self, env: Mapping[str, str] | None) -> list[str]:
        """The environment (``NAME=value``) of a tool call given ``env``: the workspace's
        :attr:`config` env updated with it; ToolCallError for a bad entry."""
        merged = {**self._config.env, **_check_env(env, "env")}
        return [f"{k}={v}" for k, v in merged.items()]

    def run(
        self,
        cmd: str,
        *,
        timeout: float | None = 30.0,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        max_output: int | None = None,
    ) -> Result:
        """Run ``cmd`` with ``bash -c`` (``/bin/sh -c`` where the rootfs has no bash) in a
        fresh process group and wait for it.

        On timeout the whole process group is killed and the result says ``timed_out``; the
        workspace stays usable. A command that is not found gives exit code 127, as in a shell.
        """
        if not isinstance(cmd, str):
            raise ToolCallError(f"cmd must be a str, got {type(cmd).__name__}")
        return self.exec([self._config.run_shell, "-c", cmd], timeout=timeout, env=env, cwd=cwd, stdin=stdin,
                         max_output=max_output)

    def exec(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = 30.0,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        max_output: int | None = None,
    ) -> Result:
        """Run ``argv`` (no shell) and wait for it; see :meth:`run`."""
        call = self._call(argv, timeout, env, cwd, stdin, max_output)
        try:
            try:
                pid = call.spawn(call.chan.spawn(call.argv, call.env, call.cwd, call.child_fds(),
                                                 user=self._config.user))
            except SpawnError as e:
                return call.not_found(e)
            deadline = call.start + call.timeout if call.timeout is not None else float("inf")
            status_box: list[int] = []

            def exited() -> bool:
                if not status_box:
                    st = call.chan.poll_exit(pid)
                    if st is not None:
                        status_box.append(st)
                return bool(status_box)

            timed_out = pump(call.read_ends(), deadline, exited)
            chan = call.chan
            if not status_box:
                left = None if call.timeout is None else max(deadline - time.monotonic(), 0)
                st = chan.wait_exit(pid, 0 if timed_out else left)
                if st is None:
                    timed_out = True
                    chan.kill(pid, signal.SIGKILL, "pgrp")
                    st = chan.wait_exit(pid, 10)
                    if st is None:
                        raise WorkspaceDied(f"workspace {self.id}: pid {pid} survived SIGKILL for 10 s")
                status_box.append(st)
            elif timed_out:
                chan.kill(pid, signal.SIGKILL, "pgrp")
            return call.result(status_box[0], timed_out)
        finally:
            call.end()

    async def arun(
        self,
        cmd: str,
        *,
        timeout: float | None = 30.0,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        max_output: int | None = None,
    ) -> Result:
        """:meth:`run` for asyncio: the event loop runs on while the call does. Cancelling the
        awaiting task kills the call's process group; the workspace stays usable."""
        if not isinstance(cmd, str):
            raise ToolCallError(f"cmd must be a str, got {type(cmd).__name__}")
        return await self.aexec([self._config.run_shell, "-c", cmd], timeout=timeout, env=env, cwd=cwd,
                                stdin=stdin, max_output=max_output)

    async def aexec(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = 30.0,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        max_output: int | None = None,
    ) -> Result:
        """:meth:`exec` for asyncio; see :meth:`arun`."""
        call = self._call(argv, timeout, env, cwd, stdin, max_output)
        try:
            try:
                pid = call.spawn(await call.chan.aspawn(call.argv, call.env, call.cwd, call.child_fds(),
                                                        user=self._config.user))
            except SpawnError as e:
                return call.not_found(e)
            try:
                status, timed_out = await aio.collect(call.chan, pid, call.read_ends(), call.timeout)
            except TimeoutError:
                raise WorkspaceDied(f"workspace {self.id}: pid {pid} survived SIGKILL for 10 s") from None
            return call.result(status, timed_out)
        finally:
            call.end()

    def _call(self, argv, timeout, env, cwd, stdin, max_output) -> _ToolCall:
        """A tool call's arguments checked and its pipes made; counted as running until
        ``end()``."""
        _check_argv(argv)
        timeout = _check_timeout(timeout)
        cap = self._config.max_output if max_output is None else _check_max_output(max_output)
        chan = self.live_channel()
        envl = self.tool_env(env)
        cwd = self._config.workdir if cwd is None else _check_abs(cwd, "cwd")
        call = _ToolCall(self, chan, list(argv), envl, cwd, timeout, cap, self._stdin_fd(stdin))
        with self._shell_lock:
            self._calls += 1
        return call


    def _stdin_fd(self, data: bytes | None) -> int:
        if data is None:
            return os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        if not isinstance(data, (bytes, bytearray)):
            raise ToolCallError(f"stdin must be bytes or None, got {type(data).__name__}")
        # A memfd never blocks the writer, whatever the size.
        fd = os.memfd_create("bunshin-stdin", os.MFD_CLOEXEC)
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

    def _oom_kills(self) -> int:
        try:
            return self._body.cgroup.oom_kills() or 0  # None: no memory controller
        except Exception:  # noqa: BLE001 - accounting must not break a tool call
            return 0

    def spawn(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        log_path: str | None = None,
    ) -> int:
        """Start a background process (a server, a REPL); returns its pid in the workspace.

        Its stdin is /dev/null; stdout and stderr go to ``log_path`` inside the workspace
        (appended) or to /dev/null. Use :meth:`wait` and :meth:`kill` with the pid.
        """
        _check_argv(argv)
        chan = self.live_channel()
        envl = self.tool_env(env)
        cwd = self._config.workdir if cwd is None else _check_abs(cwd, "cwd")
        null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        out = null
        if log_path is not None:
            out = self.open_path(_check_abs(log_path, "log_path"),
                                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            return chan.spawn(list(argv), envl, cwd, [null, out, out], user=self._config.user)
        finally:
            os.close(null)
            if out != null:
                os.close(out)

    def wait(self, pid: int, timeout: float | None = None) -> int | None:
        """Exit code (128 + signal when killed) of a process started by :meth:`spawn`, or
        None if it is still running after ``timeout`` seconds."""
        st = self.live_channel().wait_exit(pid, _check_timeout(timeout))
        return None if st is None else exit_code_from_status(st)[0]

    def kill(self, pid: int, sig: int = signal.SIGTERM, *, group: bool = False) -> None:
        """Send ``sig`` to a workspace process (or its process group)."""
        if isinstance(pid, bool) or not isinstance(pid, int) or pid < 2:
            raise ToolCallError(f"pid must be a workspace pid ≥ 2 (1 is init), got {pid!r}")
        err = self.live_channel().kill(pid, int(sig), "pgrp" if group else "pid")
        if err:
            raise SpawnError(f"workspace {self.id}: kill({pid}, {sig}): {os.strerror(err)}")

    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        """Signal every process in the workspace except its init."""
        self.live_channel().kill(0, int(sig), "all")

    def shell(self, *, env: Mapping[str, str] | None = None, cwd: str | None = None) -> Shell:
        """A persistent bash session on a terminal: ``cd``, variables, functions, history
        and background jobs persist between :meth:`Shell.run` calls."""
        sh = Shell.start(self, env=env, cwd=cwd)
        with self._shell_lock:
            self._shells.append(sh)
        return sh

    def forget_shell(self, sh: Shell) -> None:
        """Drop a closed session from :attr:`shells` (:meth:`Shell.close` does)."""
        with self._shell_lock:
            if sh in self._shells:
                self._shells.remove(sh)

    # -- forking ------------------------------------------------------------------------
    def fork(self, n: int = 1, on_fork: Callable[[Workspace], None] | None = None) -> list[Workspace]:
        """``n`` live copies of this workspace: every process (same PIDs), file and terminal,
        memory shared copy-on-write. This workspace runs on as itself, as after fork(2): the
        same processes, children, sessions and descriptors; the children see its files as they
        were at the fork. ``on_fork(child)`` runs once per child before its processes resume,
        in the fork engine's thread (bunshin/fork/keeper.py): it must not wait for a fork made
        by another thread (forks run there one at a time; calling fork() from on_fork is fine
        for another workspace)."""
        check_n(n)
        return self._fork(n, on_fork, unrun=False)

    def snapshot(self) -> Template:
        """This workspace's current state as a :class:`bunshin.Template` (forkable many times):
        a fork of it, kept frozen before it ever runs. This workspace runs on as itself."""
        kid = self._fork(1, None, unrun=True)[0]
        body, terminals = kid._surrender()
        try:
            core = snapshot_body(body, kid.config, [ident for ident, _m in terminals], type(self).from_body)
        except BaseException:
            for _ident, m in terminals:
                os.close(m)
            body.close(frozen=True)
            raise
        core.masters = [m for _ident, m in terminals]
        return Template(core)

    async def afork(self, n: int = 1) -> list[Workspace]:
        """:meth:`fork` for asyncio (forks run one at a time in the fork thread; the event loop
        runs on meanwhile)."""
        check_n(n)
        return await aio.in_thread(lambda: self.fork(n))

    async def asnapshot(self) -> Template:
        """:meth:`snapshot` for asyncio."""
        return await aio.in_thread(self.snapshot)

    async def aclose(self) -> None:
        """:meth:`close` for asyncio."""
        await aio.in_thread(self.close)

    def _fork(self, n: int, on_fork, unrun: bool) -> list[Workspace]:
        """``n`` forks (``unrun``: left frozen before they run) in one pass over this
        workspace's processes: frozen, seized, cloned, let go and thawed."""
        self._rebase_if_deep(1 + unrun)
        with self.steady("their output pipes lead to this process and cannot be forked: wait for them"):
            config = self.config
            if self._spares is not None and self._spares.limits != config.limits:
                self._spares.close_slots()  # made for limits changed since
                self._spares = None
            shells = [ident for ident, _master in self.terminals()]
            body = self._body
            # raises with the body running
            core = freeze_source(body, config, shells, type(self).from_body, self._spares)
            core.spares = self._spares
            try:
                kids = core.fork(n, on_fork, unrun=unrun)
            except BaseException:
                body.cgroup.thaw()  # a fork that failed before seizing left it frozen
                raise
            finally:
                core.spares = None
                core.close_slots()  # one made at the freeze and not taken (a failed fork)
                core.release()  # the children hold it (and its frozen layer) from here on
            if slots.enabled():  # the next ws.fork()/snapshot()'s directories and cgroups
                if self._spares is None:
                    self._spares = slots.Spares(config.limits, f"workspace {self.id}",
                                                 config.disk_limit)
                slots.request(self._spares, n)
            return kids

    def _surrender(self) -> tuple[Body, list[tuple[tuple[int, int, str], int]]]:
        """Give up this handle's body and its shells' terminals to the caller (a template
        made of this fork); the handle is closed."""
        with self._close_lock:
            terminals = self.terminals()
            self._closed = True
            _live.discard(self)
            for sh in self._shells:
                sh.rebind(self, None)
            with self._shell_lock:
                self._shells = []
            return self._body, terminals

    def _rebase_if_deep(self, below: int) -> None:
        """A fork's pid namespace is below its source's (a clone can only be made below its
        source), and the kernel stops at 32 levels; a workspace goes deeper each time it
        becomes a fork (``restore``, a speculation's commit), and a snapshot's children are
        ``below`` = 2 levels under it. At the limit the workspace goes back to the top level
        first: a CRIU dump and restore into this same object (the same PIDs, files, shells and
        memory contents; its memory is no longer shared with earlier templates; ~0.3 s here;
        the images go to /dev/shm for that while). Where CRIU cannot (_not_dumpable,
        no usable CRIU, a failed dump or restore) a ForkError says why and the workspace runs
        on; with ``BUNSHIN_REBASE=0`` the snapshot refuses with engine.check_depth's error."""
        with self._close_lock:
            self.live_channel()  # a closed workspace says so, as the snapshot would
            if not engine.too_deep(self.init_pid, below) or not config.rebase():
                return
        why = _not_dumpable(self)
        if why is not None:
            raise ForkError(_cannot_rebase(self, engine.MAX_PID_NS_LEVEL, why), step="depth")
        start = time.perf_counter()
        scratch = tempfile.mkdtemp(prefix="bunshin-rebase-",
                                   dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            images = os.path.join(scratch, "images")
            criu.dump_workspace(self, images)
            kid = type(self).from_body(*criu.restore(images))
        except BunshinError as e:
            raise ForkError(_cannot_rebase(self, engine.MAX_PID_NS_LEVEL, str(e)), step="depth") from e
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        self.adopt(kid)
        log_fork.info("workspace %s: moved back to the top pid namespace level (CRIU) in %.0f ms",
                      self.id, (time.perf_counter() - start) * 1e3)

    def restore(self, tpl: Template) -> None:
        """Roll back: this workspace becomes a fresh fork of ``tpl`` (the same object; shell
        sessions that existed in the template continue in their template state), two pid
        namespaces below the workspace ``tpl`` was snapshotted from."""
        self.adopt(tpl.fork(1)[0])

    def adopt(self, kid: Workspace) -> None:
        """This workspace (the same object, its Shell objects rebound) becomes ``kid``, a fork;
        its previous processes, cgroup and files are torn down. ``kid`` is spent."""
        with self._close_lock:
            if self._closed:
                kid.close()
                raise WorkspaceClosed(f"workspace {self.id} is closed")
            old = self._body
            masters = self._adopt(kid)
        for m in masters:
            os.close(m)
        old.close()

    def _adopt(self, kid: Workspace) -> list[int]:
        """Take over ``kid``'s body and shell sessions (it is a fork of a template); ``kid`` is
        spent. Returns the pty masters of our previous shells, for the caller to keep or
        close."""
        _live.discard(kid)
        mine = {sh.pid: sh for sh in self._shells}
        shells, old_masters = [], []
        for ksh in kid._shells:
            sh = mine.pop(ksh.pid, ksh)
            old_masters.append(sh.rebind(self, ksh))
            shells.append(sh)
        for sh in mine.values():  # no copy in kid: ended
            old_masters.append(sh.rebind(self, None))
        with self._shell_lock:
            self._shells = shells
        self._body = kid._body
        self._config = replace(self._config, run_shell=kid._config.run_shell)
        kid._closed = True
        kid._shells = []
        return [m for m in old_masters if m >= 0]

    def speculate(self) -> Speculation:
        """``with ws.speculate() as spec:`` run calls on ``spec.ws``, a fork; leaving the block
        keeps their state in this workspace, ``spec.rollback()`` or an exception drops it
        exactly (see :mod:`bunshin.speculate.block`)."""
        return Speculation(self)

    # -- files --------------------------------------------------------------------------
    def open_path(self, path: str, flags: int, mode: int = 0o644) -> int:
        """An fd (close-on-exec) of ``path`` opened with ``flags`` beneath the workspace's root:
        symlinks resolve inside it, never outside. ToolCallError says why it cannot."""
        self.live_channel()
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC):
            self._host_writes += 1
        try:
            # openat2 rejects a mode without O_CREAT
            fd = _syscalls.openat2(self._body.root_fd, path, flags | os.O_CLOEXEC,
                                   mode if flags & os.O_CREAT else 0, _syscalls.RESOLVE_IN_ROOT)
        except OSError as e:
            raise _file_error(self.id, path, e) from None
        if flags & os.O_CREAT:
            self.give(fd)
        return fd

    def give(self, fd: int) -> None:
        """A file the trainer (host root) made in a sandbox workspace belongs to its root
        inside, as one its root made would: host root is nobody there."""
        if self._body.userns is not None and os.fstat(fd).st_uid == 0:
            _userns.give(fd)

    def _owner(self) -> tuple[int, int]:
        """Host ids of what the workspace's user owns: what the trainer makes for it."""
        u = self._config.user
        uid, gid = (u.uid, u.gid) if u is not None else (0, 0)
        if self._body.userns is not None:
            return uid + _userns.BASE, gid + _userns.BASE
        return uid, gid

    def _own(self, fd: int) -> None:
        os.fchown(fd, *self._owner())

    def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644, parents: bool = True) -> None:
        """Write ``data`` to ``path`` inside the workspace (replacing it), creating parent
        directories when ``parents``. Symlinks resolve inside the workspace, never outside.
        What it creates belongs to the workspace's user, as if that user had written it.

        Not atomic: the file exists (empty) before its bytes are written, so a program in the
        workspace that polls for it can read it short. For such a reader, write another name
        and rename it into place (``ws.run("mv /tmp/x.part /tmp/x")``)."""
        _check_abs(path, "path")
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ToolCallError(f"data must be bytes or str, got {type(data).__name__}")
        if parents:
            self._makedirs(str(PurePosixPath(path).parent))
        new = self._config.user is not None and not self._exists(path)
        fd = self.open_path(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            if new:
                self._own(fd)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)

    def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """Contents of ``path`` inside the workspace (at most ``max_bytes``)."""
        _check_abs(path, "path")
        fd = self.open_path(path, os.O_RDONLY)
        try:
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                raise ToolCallError(f"workspace {self.id}: {path} is a directory")
            chunks, total = [], 0
            while max_bytes is None or total < max_bytes:
                b = os.read(fd, 1 << 20 if max_bytes is None else min(1 << 20, max_bytes - total))
                if not b:
                    break
                chunks.append(b)
                total += len(b)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def _makedirs(self, path: str) -> None:
        parts = [p for p in path.split("/") if p]
        cur = ""
        for part in parts:
            parent = cur or "/"
            cur = f"{cur}/{part}"
            dfd = self.open_path(parent, _O_PATH | os.O_DIRECTORY)
            try:
                os.mkdir(part, 0o755, dir_fd=dfd)
                uid, gid = self._owner()
                if (uid, gid) != (0, 0):
                    os.chown(part, uid, gid, dir_fd=dfd, follow_symlinks=False)
            except FileExistsError:
                pass
            except OSError as e:
                raise _file_error(self.id, cur, e) from None
            finally:
                os.close(dfd)

    # -- inspection ---------------------------------------------------------------------
    def processes(self) -> list[ProcessInfo]:
        """Every process in the workspace (init included), by pid inside the workspace. Its
        forks' processes, which its /proc shows too (their pid namespaces are below its own),
        are not listed."""
        self.live_channel()
        procdir = f"/proc/{self.init_pid}/root/proc"
        own_ns = os.readlink(f"/proc/{self.init_pid}/ns/pid")
        out = []
        page = os.sysconf("SC_PAGE_SIZE")
        for name in os.listdir(procdir):
            if not name.isdigit():
                continue
            try:
                if os.readlink(f"{procdir}/{name}/ns/pid") != own_ns:
                    continue
                with open(f"{procdir}/{name}/stat", "rb") as f:
                    st = f.read()
                with open(f"{procdir}/{name}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue  # exited meanwhile
            rest = st[st.rindex(b")") + 2 :].split()
            out.append(ProcessInfo(pid=int(name), ppid=int(rest[1]), state=rest[0].decode(),
                                   cmdline=[c.decode(errors="replace") for c in cmd.split(b"\0") if c],
                                   rss_bytes=int(rest[21]) * page))
        return sorted(out, key=lambda p: p.pid)

    def host_pids(self) -> list[int]:
        """Host pids of every process in the workspace's cgroup."""
        return self._body.cgroup.pids()

    @property
    def cgroup(self) -> Cgroup:
        """The workspace's cgroup (limits, stats, freezer)."""
        return self._body.cgroup

    @property
    def state_path(self):
        """Directory on the host holding the workspace's upper layer and metadata."""
        return self._body.dir.path


def _cannot_rebase(ws: Workspace, limit: int, why: str) -> str:
    return (f"workspace {ws.id} is at the kernel's limit of {limit} nested pid namespaces and "
            f"cannot be moved back to the top level through CRIU: {why}. Snapshot once "
            "(tpl = ws.snapshot()) and use tpl.fork() or ws.restore(tpl) instead of snapshotting "
            "a fork of a fork")


def _not_dumpable(ws: Workspace) -> str | None:
    """Why CRIU would refuse the workspace, known without trying: a process whose session
    leader is outside its pid namespace (a shell's job started before a fork: its clone keeps
    the template's session, docs/design.md), which CRIU cannot dump; live forks (their inits
    are children of its init)."""
    if ws.body.holds:
        return "it has live forks (their inits are children of its init): close them first"
    for hp in ws.host_pids():
        try:
            st = proc_status(hp)
        except OSError:
            continue
        if st.get("NSsid", "1").split()[-1] == "0" and st["NSpid"].split()[-1] != "1":
            return (f"process {st['NSpid'].split()[-1]} ({st.get('Name', '?')}) is in a session "
                    "whose leader is outside the workspace (a job its shell started before a fork)")
    return None



def _file_error(wsid: str, path: str, e: OSError) -> BunshinError:
    hint = {
        errno.ENOENT: "no such file or directory",
        errno.EISDIR: "is a directory",
        errno.ENOTDIR: "a parent is not a directory",
        errno.EACCES: "permission denied",
        errno.EXDEV: "path escapes the workspace",
        errno.ELOOP: "too many symlinks",
    }.get(e.errno or 0, e.strerror)
    err = ToolCallError(f"workspace {wsid}: {path}: {hint}")
    err.errno = e.errno  # type: ignore[attr-defined]
    return err
