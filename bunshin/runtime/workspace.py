"""A workspace: namespaces + overlay root + cgroup + an init that launches tool calls."""

from __future__ import annotations

import atexit
import errno
import logging
import os
import re
import signal
import socket
import stat
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Mapping, Sequence

from .. import _core
from .._core import _syscalls
from ..errors import (
    BunshinError,
    LimitError,
    PermissionDenied,
    RootfsError,
    SpawnError,
    ToolCallError,
    WorkspaceClosed,
    WorkspaceDied,
)
from . import cgroup as _cgroup
from . import rootfs as _rootfs
from .capture import DEFAULT_MAX_OUTPUT, Capture, pump
from .channel import Channel
from .reap import reap_init
from .forking import ForkingMixin
from .result import Result, exit_code_from_status
from .state import Meta, WorkspaceDir, own_start_time

if TYPE_CHECKING:
    from .shell import Shell

__all__ = ["Workspace", "ProcessInfo"]

log = logging.getLogger("bunshin.workspace")

_NS_FLAGS = (
    0x00020000  # CLONE_NEWNS
    | 0x20000000  # CLONE_NEWPID
    | 0x40000000  # CLONE_NEWNET
    | 0x08000000  # CLONE_NEWIPC
    | 0x04000000  # CLONE_NEWUTS
)
_O_PATH = getattr(os, "O_PATH", 0o10000000)
_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "xterm",
}

_live: "weakref.WeakSet[Workspace]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for ws in list(_live):
        try:
            ws.close()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


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
            raise ToolCallError(f"{what}: bad entry {k!r}={v!r}; names are non-empty str without '=' and values are str")
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


class Workspace(ForkingMixin):
    """A live, isolated Linux workspace that tool calls run in.

    Create one with :meth:`create`; use it as a context manager or call :meth:`close`.
    All methods are thread-safe.
    """

    # -- creation -----------------------------------------------------------------------
    def __init__(self) -> None:  # use Workspace.create()
        self._closed = True
        self._close_lock = threading.Lock()

    @classmethod
    def create(
        cls,
        rootfs: str | os.PathLike | None = None,
        *,
        memory_limit: int | str | None = None,
        pids_limit: int | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str = "/",
        hostname: str | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        ready_timeout: float = 30.0,
    ) -> "Workspace":
        """Start a workspace.

        ``rootfs``: None for the embedded default (a read-only view of the host's system
        with private, empty /tmp, /root, /home, /run), a directory, a tar archive, an OCI
        image (layout directory, OCI archive or ``docker save`` archive), or ``"debian:SUITE"``.
        ``memory_limit`` (bytes or "512M"/"2G") and ``pids_limit`` bound the whole workspace.
        ``env`` and ``workdir`` are the defaults for every tool call.
        """
        if os.geteuid() != 0:
            raise PermissionDenied("bunshin needs root (namespaces, mounts, cgroups); run as root")
        env = _check_env(env, "env")
        workdir = _check_abs(workdir, "workdir")
        if hostname is not None and (not isinstance(hostname, str) or not _HOSTNAME.match(hostname)):
            raise BunshinError(f"hostname must be a valid host name (letters, digits, '-'; ≤ 63), got {hostname!r}")
        max_output = _check_max_output(max_output)
        if pids_limit is not None and (isinstance(pids_limit, bool) or not isinstance(pids_limit, int) or pids_limit < 1):
            raise LimitError(f"pids_limit must be an int ≥ 1 (processes + threads in the workspace), got {pids_limit!r}")
        rfs = _rootfs.resolve(rootfs)

        self = cls()
        self._closed = False
        self._template = None
        self._init_is_child = True
        self._limits = {"memory_limit": memory_limit, "pids_limit": pids_limit}
        self._hostname = hostname or ""
        self._env = {**DEFAULT_ENV, **env}
        self._workdir = workdir
        self._max_output = max_output
        self._shell_lock = threading.Lock()
        self._shells: list = []
        self._calls = 0  # exec() calls in flight: their pipes lead to us, a fork cannot carry them
        self._root_fd = -1
        self._pidfd = -1
        self._chan: Channel | None = None
        self._cg = None
        self._dir = WorkspaceDir.create()
        self.id = self._dir.id
        self.rootfs = rfs
        owner_start = own_start_time()
        self._meta = Meta(id=self.id, owner_pid=os.getpid(), owner_start=owner_start,
                          cgroup=f"ws-{self.id}", rootfs=rfs.source,
                          lowers=[str(p) for p in rfs.lowers])
        try:
            self._dir.write_meta(self._meta)
            rfs.prepare_upper(self._dir.upper)
            self._cg = _cgroup.backend().create(self._meta.cgroup, memory_limit=memory_limit,
                                                pids_limit=pids_limit)
            self._hostname = hostname or f"bunshin-{self.id[:6]}"
            self._start_init(self._hostname, ready_timeout)
        except BaseException:
            self._teardown()
            raise
        _live.add(self)
        log.info("workspace %s up (init host pid %d, rootfs %s)", self.id, self.init_pid, rfs.source)
        return self

    def _start_init(self, hostname: str, ready_timeout: float) -> None:
        d = self._dir
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        logfd = os.open(d.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        argv = ["bunshin-init", "--root", str(d.root),
                "--lower", ":".join(str(p) for p in self.rootfs.lowers),
                "--upper", str(d.upper), "--work", str(d.work), "--hostname", hostname]
        for f in self._cg.procs_files():
            argv += ["--cgroup", f]
        try:
            pid, pidfd = _syscalls.clone_exec(_NS_FLAGS, str(_core.init_path()), argv,
                                              ["PATH=" + DEFAULT_ENV["PATH"]], (null, null, logfd),
                                              theirs.fileno())
        except OSError as e:
            ours.close()
            raise BunshinError(f"cannot start the workspace init: {e} (see `bunshin doctor`)") from None
        finally:
            theirs.close()
            os.close(logfd)
            os.close(null)
        self.init_pid = pid
        self._pidfd = pidfd
        self._chan = Channel(ours, f"workspace {self.id}")
        try:
            self._chan.wait_ready(ready_timeout)
        except WorkspaceDied as e:
            msg = str(e)
            if "mount overlay" in msg:
                raise RootfsError(f"{msg}\nthe rootfs {self.rootfs.source!r} cannot be used as an overlay lower layer") from None
            raise
        self._meta.init_pid = pid
        self._dir.write_meta(self._meta)
        self._root_fd = os.open(f"/proc/{pid}/root", _O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self._run_shell = "/bin/bash" if self._exists("/bin/bash") else "/bin/sh"

    def _exists(self, path: str) -> bool:
        try:
            os.close(self._open_in_root(path, _O_PATH))
            return True
        except ToolCallError:
            return False

    # -- lifetime -----------------------------------------------------------------------
    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"init={getattr(self, 'init_pid', '?')}"
        return f"<Workspace {getattr(self, 'id', '?')} {state}>"

    @property
    def closed(self) -> bool:
        return self._closed

    def _live_chan(self) -> Channel:
        if self._closed:
            raise WorkspaceClosed(f"workspace {getattr(self, 'id', '?')} is closed; create or fork a new one")
        assert self._chan is not None
        return self._chan

    def close(self) -> None:
        """Kill every process of the workspace and remove its cgroup, mounts and files."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            _live.discard(self)
            self._teardown()

    def _teardown(self) -> None:
        spares = self.__dict__.pop("_spares", None)
        if spares is not None:
            spares.close_slots()
        for sh in list(getattr(self, "_shells", [])):
            sh._detach()
        if self._chan is not None:
            self._chan.shutdown()
        if self._pidfd >= 0:
            self._reap_init()
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1
        if self._cg is not None:
            self._cg.destroy()
        self._dir.remove()
        if self._template is not None:
            self._template.release()
            self._template = None

    def _reap_init(self) -> None:
        # Init's exit tears down the pid namespace: the kernel kills and reaps every member.
        # It was asked to shut down; a forked init is reaped by its template's init, not us.
        reap_init(self._pidfd, is_child=self._init_is_child, grace=5)
        self._pidfd = -1

    # -- tool calls ---------------------------------------------------------------------
    def _call_env(self, env: Mapping[str, str] | None) -> list[str]:
        merged = {**self._env, **_check_env(env, "env")}
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
        return self.exec([self._run_shell, "-c", cmd], timeout=timeout, env=env, cwd=cwd, stdin=stdin,
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
        _check_argv(argv)
        timeout = _check_timeout(timeout)
        cap = self._max_output if max_output is None else _check_max_output(max_output)
        chan = self._live_chan()
        envl = self._call_env(env)
        cwd = self._workdir if cwd is None else _check_abs(cwd, "cwd")
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        in_fd = self._stdin_fd(stdin)
        oom_before = self._oom_kills()
        start = time.monotonic()
        with self._shell_lock:
            self._calls += 1
        try:
            return self._exec(chan, argv, envl, cwd, in_fd, out_r, out_w, err_r, err_w, cap, timeout,
                              start, oom_before)
        finally:
            with self._shell_lock:
                self._calls -= 1

    def _exec(self, chan, argv, envl, cwd, in_fd, out_r, out_w, err_r, err_w, cap, timeout, start,
              oom_before) -> Result:
        try:
            try:
                pid = chan.spawn(list(argv), envl, cwd, [in_fd, out_w, err_w])
            finally:
                os.close(out_w)
                os.close(err_w)
                os.close(in_fd)
        except SpawnError as e:
            os.close(out_r)
            os.close(err_r)
            if getattr(e, "step", "") == "exec" and getattr(e, "errno", 0) == errno.ENOENT:
                return Result(b"", f"bunshin: {argv[0]}: command not found\n".encode(), 127,
                              time.monotonic() - start)
            raise
        caps = {out_r: Capture(cap), err_r: Capture(cap)}
        deadline = start + timeout if timeout is not None else float("inf")
        status_box: list[int] = []

        def exited() -> bool:
            if not status_box:
                st = chan.poll_exit(pid)
                if st is not None:
                    status_box.append(st)
            return bool(status_box)

        timed_out = pump(caps, deadline, exited)
        if not status_box:
            left = None if timeout is None else max(deadline - time.monotonic(), 0)
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
        code, sig = exit_code_from_status(status_box[0])
        out, err = caps[out_r], caps[err_r]
        return Result(bytes(out.buf), bytes(err.buf), code, time.monotonic() - start,
                      timed_out=timed_out, truncated=bool(out.dropped or err.dropped),
                      signal=sig, oom_killed=self._oom_kills() > oom_before)

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
            return self._cg.stats().oom_kills
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
        chan = self._live_chan()
        envl = self._call_env(env)
        cwd = self._workdir if cwd is None else _check_abs(cwd, "cwd")
        null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        out = null
        if log_path is not None:
            out = self._open_in_root(_check_abs(log_path, "log_path"),
                                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            return chan.spawn(list(argv), envl, cwd, [null, out, out])
        finally:
            os.close(null)
            if out != null:
                os.close(out)

    def wait(self, pid: int, timeout: float | None = None) -> int | None:
        """Exit code (128 + signal when killed) of a process started by :meth:`spawn`, or
        None if it is still running after ``timeout`` seconds."""
        st = self._live_chan().wait_exit(pid, _check_timeout(timeout))
        return None if st is None else exit_code_from_status(st)[0]

    def kill(self, pid: int, sig: int = signal.SIGTERM, *, group: bool = False) -> None:
        """Send ``sig`` to a workspace process (or its process group)."""
        if isinstance(pid, bool) or not isinstance(pid, int) or pid < 2:
            raise ToolCallError(f"pid must be a workspace pid ≥ 2 (1 is init), got {pid!r}")
        err = self._live_chan().kill(pid, int(sig), "pgrp" if group else "pid")
        if err:
            raise SpawnError(f"workspace {self.id}: kill({pid}, {sig}): {os.strerror(err)}")

    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        """Signal every process in the workspace except its init."""
        self._live_chan().kill(0, int(sig), "all")

    def shell(self, *, env: Mapping[str, str] | None = None, cwd: str | None = None) -> "Shell":
        """A persistent bash session on a terminal: ``cd``, variables, functions, history
        and background jobs persist between :meth:`Shell.run` calls."""
        from .shell import Shell

        sh = Shell._open(self, env=env, cwd=cwd)
        with self._shell_lock:
            self._shells.append(sh)
        return sh

    # -- files --------------------------------------------------------------------------
    def _open_in_root(self, path: str, flags: int, mode: int = 0o644) -> int:
        self._live_chan()
        try:
            # openat2 rejects a mode without O_CREAT
            return _syscalls.openat2(self._root_fd, path, flags | os.O_CLOEXEC,
                                     mode if flags & os.O_CREAT else 0, _syscalls.RESOLVE_IN_ROOT)
        except OSError as e:
            raise _file_error(self.id, path, e) from None

    def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644, parents: bool = True) -> None:
        """Write ``data`` to ``path`` inside the workspace (replacing it), creating parent
        directories when ``parents``. Symlinks resolve inside the workspace, never outside.

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
        fd = self._open_in_root(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)

    def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """Contents of ``path`` inside the workspace (at most ``max_bytes``)."""
        _check_abs(path, "path")
        fd = self._open_in_root(path, os.O_RDONLY)
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
            dfd = self._open_in_root(parent, _O_PATH | os.O_DIRECTORY)
            try:
                os.mkdir(part, 0o755, dir_fd=dfd)
            except FileExistsError:
                pass
            except OSError as e:
                raise _file_error(self.id, cur, e) from None
            finally:
                os.close(dfd)

    # -- inspection ---------------------------------------------------------------------
    def processes(self) -> list[ProcessInfo]:
        """Every process in the workspace (init included), by pid inside the workspace."""
        self._live_chan()
        procdir = f"/proc/{self.init_pid}/root/proc"
        out = []
        page = os.sysconf("SC_PAGE_SIZE")
        for name in os.listdir(procdir):
            if not name.isdigit():
                continue
            try:
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
        return self._cg.pids() if self._cg is not None else []

    @property
    def cgroup(self):  # noqa: ANN201 - the backend's Cgroup type
        """The workspace's cgroup (limits, stats, freezer)."""
        return self._cg

    @property
    def state_path(self):  # noqa: ANN201
        """Directory on the host holding the workspace's upper layer and metadata."""
        return self._dir.path


def _file_error(wsid: str, path: str, e: OSError) -> BunshinError:
    hint = {
        errno.ENOENT: "no such file or directory",
        errno.EISDIR: "is a directory",
        errno.ENOTDIR: "a parent is not a directory",
        errno.EACCES: "permission denied",
        errno.EXDEV: "path escapes the workspace",
        errno.ELOOP: "too many symlinks",
    }.get(e.errno, e.strerror)
    err = ToolCallError(f"workspace {wsid}: {path}: {hint}")
    err.errno = e.errno  # type: ignore[attr-defined]
    return err
