"""An environment for mini-swe-agent (PyPI ``mini-swe-agent``, ``import minisweagent``) that
runs the agent's commands in a Bunshin workspace, and forks.

It follows mini-swe-agent 2.x's environment interface (``minisweagent.Environment``), as its
``local`` and ``docker`` environments do: a pydantic config, ``execute(action, cwd="", *,
timeout=None) -> {"output", "returncode", "exception_info"}`` (stderr merged into the output;
a failure or timeout gives ``returncode -1`` and ``exception_info``), ``Submitted`` raised when
the output's first line is ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``, ``get_template_vars`` and
``serialize``. Each command runs in a new ``bash -c`` (mini-swe-agent's prompts tell the model
that ``cd`` and variables do not persist), in the workspace.

In a mini-swe-agent config::

    environment:
      environment_class: bunshin.rl.minisweagent.BunshinEnvironment
      cwd: /repo
      setup: ["git clone /src /repo", "pip install -e /repo"]

Forking: ``env.fork(n)`` gives ``n`` environments on live copies of ``env``'s workspace (files,
processes, memory shared copy-on-write) — e.g. one set-up repository, several agents;
``BunshinEnvironment.from_template(tpl, n)`` does the same from a :class:`bunshin.Template`.

Importing this module imports ``minisweagent``, which prints a banner unless
``MSWEA_SILENT_STARTUP`` is set, and reads ``$MSWEA_GLOBAL_CONFIG_DIR/.env``.
"""

from __future__ import annotations

import logging
import os
import platform
from typing import TYPE_CHECKING, Any

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel

from .types import RolloutError

if TYPE_CHECKING:
    from ..runtime.template import Template
    from ..runtime.workspace import Workspace

__all__ = ["BunshinEnvironment", "BunshinEnvironmentConfig"]

_SHELLS = ("bash", "sh", "dash", "zsh", "ksh")


class BunshinEnvironmentConfig(BaseModel):
    """Settings of a :class:`BunshinEnvironment` (keyword arguments of its constructor)."""

    cwd: str = "/"
    """Working directory of every command (absolute; created if missing)."""
    env: dict[str, str] = {}
    """Environment variables set for every command (over the workspace's defaults)."""
    timeout: float = 30
    """Seconds a command may run; then its process group is killed (returncode -1)."""
    interpreter: list[str] = ["bash", "-c"]
    """Runs a command: the command is appended as the last argument."""
    merge_stderr: bool = True
    """Interleave stderr into the output as a terminal would (POSIX-shell interpreters only)."""
    rootfs: str | None = None
    """The workspace's rootfs when this environment creates it (see ``Workspace.create``)."""
    memory_limit: int | str | None = None
    pids_limit: int | None = None
    hostname: str | None = None
    setup: list[str] = []
    """Commands run once, in order, in ``cwd`` when this environment creates its workspace
    (not in forks: they inherit the result). One failing raises :class:`RolloutError`."""
    setup_timeout: float = 600
    """Seconds each setup command may run."""


class BunshinEnvironment:
    """mini-swe-agent environment on a Bunshin workspace (see the module docstring).

    ``workspace``: run on this live workspace instead of creating one (``config.setup`` is
    then not run). ``own_workspace``: whether :meth:`close` closes it (default: True when this
    environment created it or is a fork, False for a workspace passed in).
    """

    def __init__(self, *, config_class: type = BunshinEnvironmentConfig, logger: logging.Logger | None = None,
                 workspace: Workspace | None = None, own_workspace: bool | None = None, **kwargs: Any) -> None:
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.config = config_class(**kwargs)
        if not os.path.isabs(self.config.cwd):
            raise RolloutError(f"BunshinEnvironment: cwd must be an absolute path, got {self.config.cwd!r}")
        if not self.config.interpreter:
            raise RolloutError("BunshinEnvironment: interpreter must name a program, e.g. ['bash', '-c']")
        if workspace is None:
            self.workspace = self._create()
            self.own_workspace = True if own_workspace is None else own_workspace
        else:
            self.workspace = workspace
            self.own_workspace = bool(own_workspace)

    def _create(self) -> Workspace:
        from ..runtime.workspace import Workspace

        c = self.config
        ws = Workspace.create(c.rootfs, memory_limit=c.memory_limit, pids_limit=c.pids_limit,
                              hostname=c.hostname)
        try:
            r = ws.exec(["mkdir", "-p", c.cwd])
            if not r.ok:
                raise RolloutError(f"BunshinEnvironment: cannot create cwd {c.cwd!r}: {r.output.strip()}")
            for n, cmd in enumerate(c.setup):
                r = ws.exec([*c.interpreter, cmd], cwd=c.cwd, env=c.env, timeout=c.setup_timeout)
                if not r.ok:
                    why = "timed out" if r.timed_out else f"exited {r.exit_code}"
                    raise RolloutError(f"BunshinEnvironment: setup command {n} {cmd!r} {why}: "
                                       f"{r.output[-800:]!r}")
            self.logger.debug("workspace %s ready (%d setup commands)", ws.id, len(c.setup))
            return ws
        except BaseException:
            ws.close()
            raise

    # -- the mini-swe-agent interface -----------------------------------------------------
    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]`` in the workspace; the output dict mini-swe-agent expects."""
        command = action.get("command", "")
        cwd = cwd or self.config.cwd
        timeout = timeout or self.config.timeout
        interp = self.config.interpreter
        if self.config.merge_stderr and os.path.basename(interp[0]) in _SHELLS:
            command_arg = "exec 2>&1; " + command  # same line: bash's "line N" messages unchanged
        else:
            command_arg = command
        try:
            r = self.workspace.exec([*interp, command_arg], cwd=cwd, env=self.config.env, timeout=timeout)
            if r.timed_out:
                msg = f"Command '{command}' timed out after {timeout:g} seconds"
                output = {
                    "output": r.output,
                    "returncode": -1,
                    "exception_info": f"An error occurred while executing the command: {msg}",
                    "extra": {"exception_type": "TimeoutExpired", "exception": msg},
                }
            else:
                output = {"output": r.output, "returncode": r.exit_code, "exception_info": ""}
        except Exception as e:  # noqa: BLE001 - shown to the agent, as mini-swe-agent's local env does
            output = {
                "output": "",
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {e}",
                "extra": {"exception_type": type(e).__name__, "exception": str(e)},
            }
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict) -> None:
        """Raises Submitted if the output indicates task completion."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted({
                "role": "exit",
                "content": submission,
                "extra": {"exit_status": "Submitted", "submission": submission},
            })

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """The config, the machine's ``uname`` fields (system, release, ...) and ``kwargs``."""
        return recursive_merge(self.config.model_dump(), platform.uname()._asdict(), kwargs)

    def serialize(self) -> dict:
        """This environment's part of a saved trajectory."""
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}",
                },
                "bunshin": {"workspace_id": self.workspace.id},
            }
        }

    # -- forking --------------------------------------------------------------------------
    def fork(self, n: int = 1) -> list[BunshinEnvironment]:
        """``n`` environments, same config, each on a live fork of this one's workspace (they
        own their forks). This environment continues unchanged. Each call nests one pid
        namespace deeper (32 levels): for many forks of one state use :meth:`snapshot` and
        :meth:`from_template`."""
        return self._wrap(self.workspace.fork(n))

    def snapshot(self) -> Template:
        """A :class:`bunshin.Template` of this environment's workspace (close it when done)."""
        return self.workspace.snapshot()

    @classmethod
    def from_template(cls, template: Template, n: int = 1, **kwargs: Any) -> list[BunshinEnvironment]:
        """``n`` environments on forks of ``template`` (``kwargs``: config and ``logger``)."""
        kids = template.fork(n)
        try:
            return [cls(workspace=k, own_workspace=True, **kwargs) for k in kids]
        except BaseException:
            for k in kids:
                k.close()
            raise

    def _wrap(self, kids: list[Workspace]) -> list[BunshinEnvironment]:
        try:
            return [type(self)(config_class=type(self.config), logger=self.logger, workspace=k,
                               own_workspace=True, **self.config.model_dump()) for k in kids]
        except BaseException:
            for k in kids:
                k.close()
            raise

    # -- lifetime -------------------------------------------------------------------------
    def cleanup(self) -> None:
        """Close the workspace if this environment owns it (idempotent)."""
        if self.own_workspace and not self.workspace.closed:
            self.workspace.close()

    close = cleanup

    def __enter__(self) -> BunshinEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        return f"<BunshinEnvironment {self.workspace.id} cwd={self.config.cwd}>"
