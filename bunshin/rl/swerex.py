"""A SWE-ReX deployment and runtime (PyPI ``swe-rex``, ``import swerex``) on a Bunshin
workspace, and forks of it.

:class:`BunshinDeployment` is an ``AbstractDeployment`` (``start``/``stop``/``runtime``/
``is_alive``/``add_hook``) and :class:`BunshinRuntime` an ``AbstractRuntime`` taking and
giving swe-rex's own request and response models, raising its own exceptions, so code
written against SWE-ReX (SWE-agent's tools, mini-swe-agent's SWE-ReX environments) runs on
a workspace as on a Docker container::

    dep = BunshinDeployment(workdir="/repo", setup=["git clone /src /repo"])
    await dep.start()
    await dep.runtime.create_session(CreateBashSessionRequest())
    obs = await dep.runtime.run_in_session(BashAction(command="cd /repo && ls", check="silent"))
    kids = await dep.fork(4)      # four deployments on live copies, sessions included
    tpl = await dep.snapshot()    # or many, each BunshinDeployment(template=tpl), sessions too
    await dep.stop()

Differences from swe-rex's own runtime, where a workspace does better or cannot do the same:
a session command that times out is interrupted (^C, then SIGKILL of its job) before
``CommandTimeoutError`` is raised, so the session is usable at once; ``Command.env`` is laid
over the workspace's environment rather than replacing it (a workspace has no host
environment to inherit); a relative path names a file under the deployment's ``workdir``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import stat
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (
    AbstractRuntime,
    Action,
    BashAction,
    BashInterruptAction,
    BashObservation,
    CloseBashSessionResponse,
    CloseResponse,
    CloseSessionRequest,
    CloseSessionResponse,
    Command,
    CommandResponse,
    CreateBashSessionResponse,
    CreateSessionRequest,
    CreateSessionResponse,
    IsAliveResponse,
    Observation,
    ReadFileRequest,
    ReadFileResponse,
    UploadRequest,
    UploadResponse,
    WriteFileRequest,
    WriteFileResponse,
)

from ..runtime import aio
from .types import RolloutError

if TYPE_CHECKING:
    from ..runtime.shell import Shell
    from ..runtime.template import Template
    from ..runtime.workspace import Workspace

__all__ = ["BunshinDeployment", "BunshinRuntime"]

PROMPT = "SHELLPS1PREFIX"
"""``BashObservation.expect_string`` when the command ended at bash's prompt: the PS1 swe-rex's
own sessions match, so callers comparing with it see the same."""

_SESSION_NAMES: weakref.WeakKeyDictionary[Template, dict[str, str]] = weakref.WeakKeyDictionary()
"""The session names of the deployment each template was snapshotted from: a fork's shells
keep their session ids, not the names swe-rex gave them."""

_ANSI = re.compile(r"\x1B[@-_][0-?]*[ -/]*[@-~]")


def _text(data: bytes) -> str:
    # swe-rex decodes with backslashreplace and strips terminal escapes from session output
    return _ANSI.sub("", data.decode("utf-8", errors="backslashreplace")).replace("\r\n", "\n")


class BunshinRuntime(AbstractRuntime):
    """swe-rex's runtime API on one workspace: bash sessions are Bunshin shell sessions
    (``Workspace.shell``), ``execute`` a tool call (``Workspace.aexec``), files are read and
    written through the workspace's root. ``close`` ends the sessions, not the workspace."""

    def __init__(self, workspace: Workspace, *, cwd: str = "/", env: dict[str, str] | None = None,
                 sessions: dict[str, Shell] | None = None, logger: logging.Logger | None = None) -> None:
        self.workspace = workspace
        self.cwd = cwd
        self.env = dict(env or {})
        self.sessions: dict[str, Shell] = dict(sessions or {})
        self.logger = logger or logging.getLogger("bunshin.rl.swerex")

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        if self.workspace.closed:
            return IsAliveResponse(is_alive=False, message=f"workspace {self.workspace.id} is closed")
        return IsAliveResponse(is_alive=True)

    # -- sessions -------------------------------------------------------------------------
    async def create_session(self, request: CreateSessionRequest) -> CreateSessionResponse:
        if request.session in self.sessions:
            raise SessionExistsError(f"session {request.session} already exists")
        sh = await aio.in_thread(lambda: self.workspace.shell(cwd=self.cwd, env=self.env))
        self.sessions[request.session] = sh
        out = b""
        for path in request.startup_source:
            r = await sh.arun(f"source {path}", timeout=max(request.startup_timeout, 1.0))
            out += r.stdout
        return CreateBashSessionResponse(output=_text(out))

    def _session(self, name: str) -> Shell:
        sh = self.sessions.get(name)
        if sh is None:
            raise SessionDoesNotExistError(f"session {name!r} does not exist")
        return sh

    async def run_in_session(self, action: Action) -> Observation:
        sh = self._session(action.session)
        if isinstance(action, BashInterruptAction):
            return await self._interrupt(sh, action)
        if action.is_interactive_command or action.is_interactive_quit:
            return await self._interactive(sh, action)
        await self._check_syntax(action.command)
        if action.expect:
            out, hit = await aio.in_thread(lambda: sh.send(action.command + "\n", until=action.expect,
                                                           timeout=action.timeout))
            if hit is None:
                raise CommandTimeoutError(f"timeout after {action.timeout} seconds while running command "
                                          f"{action.command!r}")
            code = hit if isinstance(hit, int) else None
            expect = PROMPT if isinstance(hit, int) else hit
            obs = BashObservation(output=_text(out), exit_code=code, expect_string=expect)
        else:
            r = await sh.arun(action.command, timeout=action.timeout)
            if r.timed_out:
                raise CommandTimeoutError(f"timeout after {action.timeout} seconds while running command "
                                          f"{action.command!r}")
            obs = BashObservation(output=_text(r.stdout), exit_code=r.exit_code, expect_string=PROMPT)
        if action.check == "ignore":
            obs.exit_code = None
        elif action.check == "raise" and obs.exit_code != 0:
            msg = (f"Command {action.command!r} failed with exit code {obs.exit_code}. Here is the output:\n"
                   f"{obs.output!r}")
            raise NonZeroExitCodeError(f"{action.error_msg}: {msg}" if action.error_msg else msg)
        return obs

    async def _check_syntax(self, command: str) -> None:
        r = await self.workspace.aexec(["bash", "-n"], stdin=command.encode(), cwd="/", timeout=30)
        if r.exit_code != 0:
            out, err = _text(r.stdout), _text(r.stderr)
            raise BashIncorrectSyntaxError(
                f"Error (exit code {r.exit_code}) while checking bash command \n{command!r}\n"
                f"---- Stderr ----\n{err}\n---- Stdout ----\n{out}",
                extra_info={"bash_stdout": out, "bash_stderr": err})

    async def _interactive(self, sh: Shell, action: BashAction) -> BashObservation:
        # a line for the program in the foreground (a REPL, a debugger): no exit code exists
        out, hit = await aio.in_thread(lambda: sh.send(action.command + "\n", until=action.expect,
                                                       timeout=action.timeout))
        if hit is None:
            raise CommandTimeoutError(f"timeout after {action.timeout} seconds while running command "
                                      f"{action.command!r}")
        text = _text(out)
        if not action.is_interactive_quit:
            text = text.lstrip().removeprefix(action.command).strip()
        return BashObservation(output=text, exit_code=0, expect_string=PROMPT if isinstance(hit, int) else hit)

    async def _interrupt(self, sh: Shell, action: BashInterruptAction) -> BashObservation:
        out = b""
        for _ in range(max(action.n_retry, 1)):
            got, hit = await aio.in_thread(lambda: sh.send("\x03", until=action.expect, timeout=action.timeout))
            out += got
            if hit is not None:
                return BashObservation(output=_text(out).strip(), exit_code=0,
                                       expect_string=PROMPT if isinstance(hit, int) else hit)
        # a program that takes ^C (a REPL) or ignores it: its job is killed, as swe-rex's own
        # session does with ^Z and kill -9 %1
        try:
            pgrp = os.tcgetpgrp(sh.master)  # a host pid
        except OSError:
            pgrp = 0
        if pgrp > 0 and pgrp != os.getpgrp():  # never our own group
            with contextlib.suppress(OSError):
                os.killpg(pgrp, signal.SIGKILL)
        got, hit = await aio.in_thread(lambda: sh.send("", until=action.expect, timeout=5))
        if hit is None:
            raise CommandTimeoutError(f"session {action.session!r}: still busy after {action.n_retry} interrupts "
                                      "and SIGKILL of its foreground job")
        return BashObservation(output=_text(out + got).strip(), exit_code=0,
                               expect_string=PROMPT if isinstance(hit, int) else hit)

    async def close_session(self, request: CloseSessionRequest) -> CloseSessionResponse:
        sh = self._session(request.session)
        del self.sessions[request.session]
        await aio.in_thread(sh.close)
        return CloseBashSessionResponse()

    # -- commands and files ---------------------------------------------------------------
    async def execute(self, command: Command) -> CommandResponse:
        """``command`` as ``subprocess.run`` would run it, in the workspace."""
        if command.shell:
            argv = ["/bin/sh", "-c", command.command if isinstance(command.command, str)
                    else " ".join(command.command)]
        else:
            argv = [command.command] if isinstance(command.command, str) else list(command.command)
        if command.merge_output_streams:
            argv = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh", *argv]
        r = await self.workspace.aexec(argv, timeout=command.timeout, env={**self.env, **(command.env or {})},
                                       cwd=self._path(command.cwd or self.cwd))
        if r.timed_out:
            raise CommandTimeoutError(f"Timeout ({command.timeout}s) exceeded while running command")
        resp = CommandResponse(stdout=r.stdout.decode(errors="backslashreplace"),
                               stderr=r.stderr.decode(errors="backslashreplace"), exit_code=r.exit_code)
        if command.check and r.exit_code != 0:
            msg = (f"Command {command.command!r} failed with exit code {r.exit_code}. "
                   f"Stdout:\n{resp.stdout!r}\nStderr:\n{resp.stderr!r}")
            raise NonZeroExitCodeError(f"{command.error_msg}: {msg}" if command.error_msg else msg)
        return resp

    def _path(self, path: str) -> str:
        return path if os.path.isabs(path) else os.path.normpath(os.path.join(self.cwd, path))

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        data = await aio.in_thread(lambda: self.workspace.read_file(self._path(request.path)))
        return ReadFileResponse(content=data.decode(request.encoding or "utf-8", errors=request.errors or "strict"))

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        await aio.in_thread(lambda: self.workspace.write_file(self._path(request.path), request.content))
        return WriteFileResponse()

    async def upload(self, request: UploadRequest) -> UploadResponse:
        """Copy a host file or directory tree (``source_path``) into the workspace
        (``target_path``), keeping permission bits and symlinks."""
        await aio.in_thread(lambda: self._upload(Path(request.source_path), self._path(request.target_path)))
        return UploadResponse()

    def _upload(self, src: Path, dst: str) -> None:
        ws = self.workspace
        if src.is_symlink():
            r = ws.exec(["ln", "-sfn", os.readlink(src), dst], cwd="/")
            if not r.ok:
                raise OSError(f"upload: cannot make the symlink {dst}: {r.output.strip()}")
        elif src.is_dir():
            r = ws.exec(["mkdir", "-p", dst], cwd="/")
            if not r.ok:
                raise OSError(f"upload: cannot make the directory {dst}: {r.output.strip()}")
            for child in sorted(src.iterdir()):
                self._upload(child, f"{dst.rstrip('/')}/{child.name}")
        else:
            ws.write_file(dst, src.read_bytes(), mode=stat.S_IMODE(src.stat().st_mode))

    async def close(self) -> CloseResponse:
        sessions, self.sessions = list(self.sessions.values()), {}
        for sh in sessions:
            if not self.workspace.closed:
                await aio.in_thread(sh.close)
        return CloseResponse()


class BunshinDeployment(AbstractDeployment):
    """A swe-rex deployment whose runtime is a Bunshin workspace.

    Where the workspace comes from: ``workspace=`` (the caller's, kept open by :meth:`stop`
    unless ``own_workspace``); ``template=`` (a fork of that :class:`bunshin.Template`, the
    caller's); else a new one (``rootfs``, ``memory_limit``, ``hostname``, ``isolation``) in
    which ``setup`` runs, command by command with ``bash -c`` in ``workdir``. ``workdir`` and
    ``env`` are the default directory and environment of sessions and commands.
    """

    def __init__(self, *, workspace: Workspace | None = None, template: Template | None = None,
                 own_workspace: bool | None = None, rootfs: str | os.PathLike | None = None,
                 workdir: str = "/", env: dict[str, str] | None = None, setup: Sequence[str] = (),
                 setup_timeout: float = 600.0, memory_limit: int | str | None = None,
                 hostname: str | None = None, isolation: str | None = None,
                 logger: logging.Logger | None = None) -> None:
        if workspace is not None and template is not None:
            raise RolloutError("BunshinDeployment: give workspace= or template=, not both")
        if not os.path.isabs(workdir):
            raise RolloutError(f"BunshinDeployment: workdir must be an absolute path, got {workdir!r}")
        if isinstance(setup, str):
            raise RolloutError("BunshinDeployment: setup is a list of commands, got a str")
        self.logger = logger or logging.getLogger("bunshin.rl.swerex")
        self._hooks = CombinedDeploymentHook()
        self._given = workspace
        self._template = template
        self._own = own_workspace if own_workspace is not None else workspace is None
        self._create: dict[str, Any] = {"memory_limit": memory_limit, "hostname": hostname,
                                        "isolation": isolation}
        self._rootfs = rootfs
        self.workdir = workdir
        self.env = dict(env or {})
        self.setup = list(setup)
        self.setup_timeout = setup_timeout
        self._runtime: BunshinRuntime | None = None
        self._sessions: dict[str, Shell] = {}

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def runtime(self) -> BunshinRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime

    @property
    def workspace(self) -> Workspace:
        """The running workspace (DeploymentNotStartedError before :meth:`start`)."""
        return self.runtime.workspace

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        if self._runtime is None:
            return IsAliveResponse(is_alive=False, message="Runtime is None.")
        return await self._runtime.is_alive(timeout=timeout)

    async def start(self, *args: Any, **kwargs: Any) -> None:
        """Make (or fork, or take) the workspace; a second call does nothing."""
        if self._runtime is not None:
            return
        self._hooks.on_custom_step("Starting Bunshin workspace")
        ws = await aio.in_thread(self._make)
        self._runtime = BunshinRuntime(ws, cwd=self.workdir, env=self.env, sessions=self._sessions,
                                       logger=self.logger)

    def _make(self) -> Workspace:
        if self._given is not None:
            return self._given
        if self._template is not None:
            kid = self._template.fork(1)[0]
            by_id = {sh.id: sh for sh in kid.shells}
            names = _SESSION_NAMES.get(self._template, {})
            self._sessions = {name: by_id[sid] for name, sid in names.items() if sid in by_id}
            return kid
        from ..runtime.workspace import Workspace

        ws = Workspace.create(self._rootfs, workdir=self.workdir, env=self.env, **self._create)
        try:
            r = ws.exec(["mkdir", "-p", self.workdir], cwd="/")
            if not r.ok:
                raise RolloutError(f"BunshinDeployment: cannot create workdir {self.workdir!r}: {r.output.strip()}")
            for n, cmd in enumerate(self.setup):
                self._hooks.on_custom_step(f"Setup command {n}")
                r = ws.exec(["bash", "-c", cmd], timeout=self.setup_timeout)
                if not r.ok:
                    why = "timed out" if r.timed_out else f"exited {r.exit_code}"
                    raise RolloutError(f"BunshinDeployment: setup command {n} {cmd!r} {why}: {r.output[-800:]!r}")
            return ws
        except BaseException:
            ws.close()
            raise

    async def stop(self, *args: Any, **kwargs: Any) -> None:
        """End the sessions and close the workspace if this deployment owns it (idempotent)."""
        rt, self._runtime = self._runtime, None
        if rt is None:
            return
        await rt.close()
        if self._own and not rt.workspace.closed:
            await rt.workspace.aclose()

    # -- forking --------------------------------------------------------------------------
    async def fork(self, n: int = 1) -> list[BunshinDeployment]:
        """``n`` started deployments, each on a live fork of this one's workspace (files,
        processes, memory copy-on-write), owning it; every bash session continues in each
        under its name (cwd, variables, a running REPL). This deployment runs on unchanged.
        Each call nests a pid namespace deeper (32 levels): for many forks of one state,
        :meth:`snapshot` and ``BunshinDeployment(template=...)``."""
        rt = self.runtime
        kids = await rt.workspace.afork(n)
        out = []
        for k in kids:
            by_id = {sh.id: sh for sh in k.shells}
            sessions = {name: by_id[sh.id] for name, sh in rt.sessions.items() if sh.id in by_id}
            d = BunshinDeployment(workspace=k, own_workspace=True, workdir=self.workdir, env=self.env,
                                  logger=self.logger)
            d._runtime = BunshinRuntime(k, cwd=self.workdir, env=self.env, sessions=sessions, logger=self.logger)
            out.append(d)
        return out

    async def snapshot(self) -> Template:
        """A :class:`bunshin.Template` of the workspace now (the caller closes it); a
        deployment started from it has this one's bash sessions, under their names."""
        rt = self.runtime
        tpl = await rt.workspace.asnapshot()
        _SESSION_NAMES[tpl] = {name: sh.id for name, sh in rt.sessions.items()}
        return tpl
