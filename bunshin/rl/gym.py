"""A gymnasium environment over Bunshin workspaces: text actions are tool calls, text
observations are their output.

>>> env = WorkspaceEnv(task, mode="fork", reward_fn=lambda ws, h: float(ws.run("pytest -q").ok))  # doctest: +SKIP
>>> obs, info = env.reset(seed=0)               # obs: the task's prompt          # doctest: +SKIP
>>> obs, r, term, trunc, info = env.step("ls /repo")                              # doctest: +SKIP
>>> obs, r, term, trunc, info = env.step(
...     '{"name": "write_file", "args": {"path": "/a", "content": "x"}}')         # doctest: +SKIP
>>> obs, r, term, trunc, info = env.step("submit")  # term=True, r=reward_fn(...) # doctest: +SKIP

Importing this module registers ``"bunshin/Workspace-v0"`` with gymnasium (flagged
``nondeterministic``: a tool call's output and duration are not a function of the seed), so
``gymnasium.make("bunshin/Workspace-v0", task=task)`` works too.
"""

from __future__ import annotations

import json
import math
import string
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import gymnasium
import numpy as np
from gymnasium import spaces

from ..cache.errors import InvalidToolCall, UnknownTool
from ..cache.toolcall import ToolCall
from ..cache.tools import BUILTIN_TOOLS, ToolContext, ToolFn, run_tool
from ..errors import BunshinError, WorkspaceClosed
from .types import History, RolloutError, Task, Turn
from .workspaces import build, rollout_shell, set_up_template

if TYPE_CHECKING:
    from ..runtime.shell import Shell
    from ..runtime.template import Template
    from ..runtime.workspace import Workspace

__all__ = ["ENV_ID", "AnyText", "WorkspaceEnv"]

ENV_ID = "bunshin/Workspace-v0"

_SAMPLE_CHARSET = string.ascii_letters + string.digits + string.punctuation + " \t\n"


class AnyText(spaces.Text):
    """A :class:`gymnasium.spaces.Text` holding any Unicode string of ``min_length`` to
    ``max_length`` characters (tool output is not limited to a charset).

    ``sample()`` without a mask draws at most ``sample_max_length`` characters from printable
    ASCII — a random "command" for checkers and random agents, not a megabyte of noise.
    """

    def __init__(self, max_length: int, *, min_length: int = 0, sample_max_length: int = 64,
                 seed: int | np.random.Generator | None = None) -> None:
        super().__init__(max_length, min_length=min_length, charset=_SAMPLE_CHARSET, seed=seed)
        self.sample_max_length = max(self.min_length, min(int(sample_max_length), self.max_length))

    def contains(self, x: Any) -> bool:
        """Any ``str`` of an allowed length."""
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        """A random printable-ASCII string (see the class docstring)."""
        if mask is None and probability is None:
            n = int(self.np_random.integers(self.min_length, self.sample_max_length + 1))
            return super().sample(mask=(n, None))
        return super().sample(mask=mask, probability=probability)

    def __repr__(self) -> str:
        return f"AnyText({self.min_length}, {self.max_length})"


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    note = f"\n[... {len(text) - limit} characters cut ...]\n"
    keep = max(0, limit - len(note))
    head = keep // 2
    return text[:head] + note + text[len(text) - (keep - head):]


RewardFn = Callable[["Workspace", History], float]
DoneFn = Callable[["Workspace", History], bool]


class WorkspaceEnv(gymnasium.Env[str, str]):
    """One episode = one rollout of ``task`` on its own workspace.

    Where the episode's workspace comes from (``reset`` closes the previous one):

    * ``template=`` a :class:`bunshin.Template` (the caller's; not closed here): a fork of it;
    * ``workspace=`` a set-up :class:`bunshin.Workspace`: it is snapshotted once, here (it keeps
      running, as a fork of the snapshot; still the caller's), and each episode gets a fork;
    * ``mode="fork"``: the task's setup runs once, at the first reset; its snapshot is forked;
    * ``mode="fresh"`` (default): a new workspace with the task's setup replayed, every episode.

    Actions (``str``): ``"submit"`` (the ``submit`` word; case and surrounding space ignored)
    ends the episode; a JSON object ``{"name": tool, "args": {...}}`` is that tool call
    (``{"name": "submit", "args": {"answer": "..."}}`` submits with an answer, in
    ``info["answer"]``); anything else is a bash command, run in the episode's persistent
    shell (cd and variables persist). Tools: the task's ``tools`` out of ``tools`` (default: the
    built-ins, with ``bash`` bounded by ``timeout`` seconds). A call the workspace rejects
    (unknown tool, bad arguments, malformed JSON action) is a step whose observation is the
    error, exit code -1 (recorded in the history as the call, or as ``invalid_action{text}``).
    ``submit`` is reserved: it is never a tool.

    Observation: the call's output (stdout then stderr; at most ``max_observation_chars``, head
    and tail kept); after ``reset`` the task's prompt; after ``submit`` "".
    Reward: 0.0, except on the episode's last step (submit, ``done_fn`` true, or truncation)
    where ``reward_fn(ws, history)`` is evaluated when given. ``done_fn(ws, history)``, when
    given, is asked after every tool step and ends the episode (terminated) when true.
    Truncated: ``max_steps`` (default ``task.max_steps``) tool steps made without an end.
    Info: ``exit_code``, ``duration`` (seconds), ``timed_out``, ``output_truncated``, ``step``,
    ``workspace_id`` (``error`` for rejected calls); after ``reset``: ``workspace_id``,
    ``setup_s``, ``episode``.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, task: Task, *, template: Template | None = None, workspace: Workspace | None = None,
                 mode: str = "fresh", reward_fn: RewardFn | None = None, done_fn: DoneFn | None = None,
                 max_steps: int | None = None, timeout: float = 30.0,
                 tools: Mapping[str, ToolFn] | None = None, submit: str = "submit",
                 max_observation_chars: int = 1 << 16, max_action_chars: int = 1 << 20) -> None:
        if not isinstance(task, Task):
            raise RolloutError(f"WorkspaceEnv: task must be a bunshin.rl.Task, got {type(task).__name__}")
        if template is not None and workspace is not None:
            raise RolloutError("WorkspaceEnv: give template= or workspace=, not both")
        if mode not in ("fresh", "fork"):
            raise RolloutError(f"WorkspaceEnv: mode must be 'fresh' or 'fork', got {mode!r}")
        max_steps = task.max_steps if max_steps is None else max_steps
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise RolloutError(f"WorkspaceEnv: max_steps must be an int ≥ 1, got {max_steps!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise RolloutError(f"WorkspaceEnv: timeout must be a positive number of seconds, got {timeout!r}")
        if not isinstance(submit, str) or not submit.strip():
            raise RolloutError(f"WorkspaceEnv: submit must be a non-empty word, got {submit!r}")
        for name, v in (("max_observation_chars", max_observation_chars), ("max_action_chars", max_action_chars)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 256:
                raise RolloutError(f"WorkspaceEnv: {name} must be an int ≥ 256, got {v!r}")
        for name, fn in (("reward_fn", reward_fn), ("done_fn", done_fn)):
            if fn is not None and not callable(fn):
                raise RolloutError(f"WorkspaceEnv: {name} must be callable(ws, history), got {fn!r}")
        self.task = task
        self.reward_fn = reward_fn
        self.done_fn = done_fn
        self.max_steps = max_steps
        self.timeout = float(timeout)
        self.submit_word = submit.strip().lower()
        self.max_observation_chars = max_observation_chars
        registry = dict(BUILTIN_TOOLS, bash=self._bash) if tools is None else dict(tools)
        self.tools: dict[str, ToolFn] = {k: v for k, v in registry.items() if k in task.tools}
        self.observation_space = AnyText(max_observation_chars)
        self.action_space = AnyText(max_action_chars, min_length=1)
        self.mode = "fork" if template is not None or workspace is not None else mode

        self._template = template
        self._own_template = False
        if workspace is not None:
            self._template = workspace.snapshot()
            self._own_template = True
        self._ws: Workspace | None = None
        self._shell: Shell | None = None
        self._episodes = 0
        self._history: History | None = None
        self._over = True
        self._closed = False

    # -- properties ---------------------------------------------------------------------
    @property
    def workspace(self) -> Workspace | None:
        """The current episode's workspace (None before the first reset and after close)."""
        return self._ws

    @property
    def history(self) -> History | None:
        """The current episode's turns, as a policy would see them."""
        return self._history

    # -- gymnasium ----------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode on a new workspace; the observation is the task's prompt."""
        super().reset(seed=seed)
        if self._closed:
            raise WorkspaceClosed("WorkspaceEnv is closed")
        self._drop_workspace()
        t0 = time.monotonic()
        if self.mode == "fork" and self._template is None:
            self._template = set_up_template(self.task, "workspace")
            self._own_template = True
        if self._template is not None:
            self._ws = self._template.fork(1)[0]
            try:
                self._shell = rollout_shell(self._ws, self.task.workdir)
            except BaseException:
                self._drop_workspace()
                raise
        else:
            self._ws, self._shell = build(self.task, "workspace")
        setup_s = time.monotonic() - t0
        self._history = History(self.task, self._episodes, [])
        self._episodes += 1
        self._over = False
        return self.task.prompt, {"workspace_id": self._ws.id, "setup_s": setup_s,
                                  "episode": self._history.index}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Run ``action`` (see the class docstring): observation, reward, terminated,
        truncated, info."""
        if self._closed:
            raise WorkspaceClosed("WorkspaceEnv is closed")
        ws, hist = self._episode()
        if self._over:
            raise RolloutError("WorkspaceEnv: the episode is over (terminated or truncated); call reset()")
        if not isinstance(action, str):
            raise RolloutError(f"WorkspaceEnv: an action is a str (a bash command or a JSON tool call), "
                               f"got {type(action).__name__}")
        info: dict[str, Any] = {"step": len(hist.turns), "workspace_id": ws.id}
        try:
            call = self.parse_action(action)
        except InvalidToolCall as e:
            try:
                bad = ToolCall("invalid_action", {"text": action})
            except InvalidToolCall:
                bad = ToolCall("invalid_action", {"text": action.encode("utf-8", "replace").decode()})
            return self._record(bad, f"error: {e}", -1, 0.0, info, error=str(e))
        if call is None or call.name == "submit":
            if call is not None:
                answer = call.args.get("answer", call.args.get("text", ""))
                info["answer"] = answer if isinstance(answer, str) else json.dumps(answer)
            self._over = True
            return "", self._reward(), True, False, info
        if call.name not in self.tools:
            err = f"no tool named {call.name!r} in this task; tools: {sorted(self.tools)} (or {self.submit_word!r})"
            return self._record(call, f"error: {err}", -1, 0.0, info, error=err)
        t0 = time.monotonic()
        try:
            r = run_tool(self.tools, ToolContext(ws, self._session_shell), call)
        except (InvalidToolCall, UnknownTool) as e:
            return self._record(call, f"error: {e}", -1, time.monotonic() - t0, info, error=str(e))
        except BunshinError as e:
            if ws.closed:
                raise
            # a bad path for read_file/write_file and the like: the agent's mistake, shown to it
            return self._record(call, f"error: {e}", -1, time.monotonic() - t0, info, error=str(e))
        info.update(timed_out=r.timed_out, output_truncated=r.truncated)
        return self._record(call, r.output, r.exit_code, r.duration, info)

    def close(self) -> None:
        """Close the episode's workspace and the snapshot this env made (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._over = True
        try:
            self._drop_workspace()
        finally:
            if self._own_template and self._template is not None:
                self._template.close()
            self._template = None

    # -- helpers ------------------------------------------------------------------------
    def parse_action(self, action: str) -> ToolCall | None:
        """The tool call ``action`` stands for; None for the submit word."""
        text = action.strip()
        if text.lower() == self.submit_word:
            return None
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError:
                obj = None  # e.g. "{ echo a; echo b; }": a bash group
            if isinstance(obj, dict):
                name, args = obj.get("name"), obj.get("args", obj.get("arguments", {}))
                if not isinstance(name, str) or not name:
                    raise InvalidToolCall('a JSON action must be {"name": tool, "args": {...}}; "name" is missing')
                if not isinstance(args, dict):
                    raise InvalidToolCall(f'"args" of a JSON action must be an object, got {args!r}')
                return ToolCall(name, args)
        return ToolCall("bash", {"command": action})

    def _episode(self) -> tuple[Workspace, History]:
        if self._ws is None or self._history is None:
            raise RolloutError("WorkspaceEnv.step before reset(): call reset() first")
        return self._ws, self._history

    def _session_shell(self) -> Shell:
        if self._shell is None or not self._shell.alive:
            self._shell = self._episode()[0].shell(cwd=self.task.workdir)
        return self._shell

    def _bash(self, ctx: ToolContext, **args: Any) -> Any:
        extra = sorted(set(args) - {"command"})
        if extra:
            raise InvalidToolCall(f"tool 'bash': unknown argument(s) {extra}; expected ['command']")
        cmd = args.get("command")
        if not isinstance(cmd, str):
            raise InvalidToolCall(f"tool 'bash': argument 'command' must be a str, got {cmd!r}")
        return ctx.shell().run(cmd, timeout=self.timeout)

    def _record(self, call: ToolCall, out: str, code: int, duration: float, info: dict[str, Any],
                error: str | None = None) -> tuple[str, float, bool, bool, dict[str, Any]]:
        ws, hist = self._episode()
        obs = _truncate(out, self.max_observation_chars)
        hist.turns.append(Turn(call, obs, code, tool_s=duration))
        info.update(exit_code=code, duration=duration)
        info.setdefault("timed_out", False)
        info.setdefault("output_truncated", False)
        if error is not None:
            info["error"] = error
        terminated = bool(self.done_fn(ws, hist)) if self.done_fn is not None else False
        truncated = not terminated and len(hist.turns) >= self.max_steps
        reward = 0.0
        if terminated or truncated:
            self._over = True
            reward = self._reward()
        return obs, reward, terminated, truncated, info

    def _reward(self) -> float:
        if self.reward_fn is None:
            return 0.0
        r = self.reward_fn(*self._episode())
        if isinstance(r, bool) or not isinstance(r, (int, float, np.floating, np.integer)) or not math.isfinite(r):
            raise RolloutError(f"WorkspaceEnv: reward_fn must return a finite number, got {r!r}")
        return float(r)

    def _drop_workspace(self) -> None:
        ws, self._ws, self._shell = self._ws, None, None
        if ws is not None:
            ws.close()


if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point="bunshin.rl.gym:WorkspaceEnv", nondeterministic=True)
