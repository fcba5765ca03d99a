"""A SkyRL-gym text environment (PyPI ``skyrl-gym``, ``import skyrl_gym``) whose tools act on
a Bunshin workspace, and whose group rollouts start from forks of one set-up state.

SkyRL's generator makes one environment per trajectory, ``skyrl_gym.make("bunshin",
env_config=..., extras=...)``, then calls ``init(prompt)``, ``step(llm_text)`` until ``done``,
``get_metrics()`` and ``close()``. Importing this module registers ``"bunshin"``.

The model's text is parsed as skyrl-gym's own multi-tool environments parse it:
``<tool><bash>ls -la</bash></tool>`` runs a tool (``bash``: the episode's persistent shell,
cd and variables persist; ``python``: ``python3 -c``; ``read_file``: a path;
``write_file``: the path on the first line, the content after it) and the observation is its
output (``[exit code N]`` appended when not 0); ``<solution>...</solution>`` ends the episode,
as does the ``max_turns``-th step (whose action is then not run, as in skyrl-gym's envs).
The reward is 0.0 until the end, then the verifier's.

``extras`` (a row of the dataset, plain data):

* ``task``: the set-up state, a :class:`bunshin.rl.Task` or a dict of its fields (``setup``:
  bash commands or ``{"name", "args"}`` tool calls, ``workdir``, ``rootfs``, ``ready``). Its
  setup runs once per process: the first environment of a task builds it and snapshots it
  into :data:`TEMPLATES`, and every environment of the task (a group's rollouts) runs on a
  fork of that snapshot;
* or ``template``: a :class:`bunshin.Template` of the caller's, forked the same way;
* ``reward_spec``: ``{"command": ..., "timeout": s}``, a bash command run in the episode's
  final workspace, or ``{"fn": callable(ws, chat_history)}``, scored as a
  :class:`bunshin.rl.Verifier` scores (the command passes on exit 0, its reward the number it
  prints last, else 1.0 / 0.0; ``fn`` returns a number, a bool, ``(reward, passed)`` or a
  Verdict); the verdict is in the last step's ``metadata["verifier"]``;
* ``max_turns`` (SkyRL's generator sets it).

``env_config`` (SkyRL's ``skyrl_gym_config.bunshin``, or a dict): ``timeout`` (seconds per
tool call, default 30), ``max_observation_chars`` (default 16384).

``env.fork(n)`` gives ``n`` environments on live forks of this one's workspace, in the same
episode (turns and chat history copied): a group branching mid-episode. ``close()`` closes the
environment's workspace; :data:`TEMPLATES` ``.close()`` the shared snapshots (also at exit).
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import re
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType
from skyrl_gym.tools.core import ToolGroup, tool

from ..cache.toolcall import ToolCall
from .types import RolloutError, Task, Verifier
from .verify import verify
from .workspaces import rollout_shell, set_up_template, setup_key

if TYPE_CHECKING:
    from ..runtime.result import Result
    from ..runtime.shell import Shell
    from ..runtime.template import Template
    from ..runtime.workspace import Workspace

__all__ = ["ENV_ID", "TEMPLATES", "BunshinTextEnv", "TemplateCache", "WorkspaceToolGroup"]

ENV_ID = "bunshin"

_TOOL = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)
_INNER = re.compile(r"<(\w+)>(.*?)</\1>", re.DOTALL)


def task_of(spec: Task | Mapping[str, Any]) -> Task:
    """``spec`` as a :class:`Task` (a dataset row holds a dict of its fields)."""
    if isinstance(spec, Task):
        return spec
    if not isinstance(spec, Mapping):
        raise RolloutError(f"BunshinTextEnv: extras['task'] must be a Task or a dict, got {type(spec).__name__}")
    fields = dict(spec)
    setup = [ToolCall(c["name"], dict(c.get("args", {}))) if isinstance(c, Mapping) else c
             for c in fields.pop("setup", ())]
    fields.setdefault("id", "skyrl")
    fields.setdefault("prompt", "")
    try:
        return Task(setup=tuple(setup), **fields)
    except TypeError as e:
        raise RolloutError(f"BunshinTextEnv: extras['task'] has a field Task does not: {e}") from None


class TemplateCache:
    """One snapshot per set-up state, built by the first environment that needs it while the
    others of its group wait, then forked by all. Thread-safe (SkyRL steps environments in a
    thread pool)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[bytes, tuple[threading.Lock, list[Template]]] = {}
        self.builds = 0

    key = staticmethod(setup_key)

    def get(self, task: Task) -> Template:
        """The snapshot of ``task``'s set-up state (built now if this process has none)."""
        k = self.key(task)
        with self._lock:
            lock, box = self._entries.setdefault(k, (threading.Lock(), []))
        with lock:
            if not box or box[0].closed:
                box[:] = [set_up_template(task)]
                self.builds += 1
            return box[0]

    def close(self) -> None:
        """Close every snapshot (environments already forked from them run on)."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for _, box in entries:
            for tpl in box:
                tpl.close()


TEMPLATES = TemplateCache()
"""The process's shared snapshots of set-up states."""
atexit.register(TEMPLATES.close)


class WorkspaceToolGroup(ToolGroup):
    """skyrl-gym tools acting on one episode's workspace; each returns the observation text
    and keeps the call's result in :attr:`last`."""

    def __init__(self, env: BunshinTextEnv) -> None:
        self._env = env
        self.last: Result | None = None
        super().__init__(name="BunshinWorkspaceToolGroup")

    def _shown(self, r: Result) -> str:
        self.last = r
        out = r.output
        limit = self._env.max_observation_chars
        if len(out) > limit:
            out = out[: limit // 2] + f"\n[... {len(out) - limit} characters cut ...]\n" + out[-(limit // 2):]
        if r.timed_out:
            out += f"\n[timed out after {self._env.timeout:g} s]"
        elif r.exit_code != 0:
            out += f"\n[exit code {r.exit_code}]"
        return out

    @tool
    def bash(self, command: str) -> str:
        return self._shown(self._env.shell().run(command, timeout=self._env.timeout))

    @tool
    def python(self, code: str) -> str:
        return self._shown(self._env.workspace.exec(["python3", "-c", code], timeout=self._env.timeout))

    @tool
    def read_file(self, path: str) -> str:
        from ..runtime.result import Result

        data = self._env.workspace.read_file(path.strip())
        return self._shown(Result(data, b"", 0, 0.0))

    @tool
    def write_file(self, text: str) -> str:
        from ..runtime.result import Result

        path, _, content = text.lstrip("\n").partition("\n")
        self._env.workspace.write_file(path.strip(), content)
        return self._shown(Result(f"wrote {len(content.encode())} bytes to {path.strip()}".encode(), b"", 0, 0.0))


class BunshinTextEnv(BaseTextEnv):
    """A skyrl-gym ``BaseTextEnv`` on a workspace forked from the task's set-up state (see
    the module docstring)."""

    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        extras = dict(extras or {})
        cfg = env_config if env_config is not None else {}
        self.timeout = float(cfg.get("timeout", 30.0))
        self.max_observation_chars = int(cfg.get("max_observation_chars", 16384))
        self.max_turns = int(extras.get("max_turns", 10))
        if "template" in extras:
            self._template: Template | None = extras["template"]
            self.task = task_of(extras.get("task", {}))
        elif "task" in extras:
            self._template = None
            self.task = task_of(extras["task"])
        else:
            raise RolloutError("BunshinTextEnv: extras needs 'task' (the set-up state) or 'template'")
        self.reward_spec = dict(extras.get("reward_spec", {}))
        if not ("command" in self.reward_spec or callable(self.reward_spec.get("fn"))):
            raise RolloutError("BunshinTextEnv: extras['reward_spec'] needs 'command' (a bash verifier) or "
                               f"'fn' (callable(ws, chat_history)), got {sorted(self.reward_spec)}")
        self.extras = extras
        self.env_config = env_config
        self.tool_group = WorkspaceToolGroup(self)
        self.init_tool_groups([self.tool_group])
        self.chat_history: ConversationType = []
        self.reward = 0.0
        self.verifier: dict[str, Any] = {}
        self.tool_errors = 0
        self._ws: Workspace | None = None
        self._shell: Shell | None = None
        self._closed = False

    # -- the workspace --------------------------------------------------------------------
    @property
    def workspace(self) -> Workspace:
        if self._ws is None:
            raise RolloutError("BunshinTextEnv: no workspace before init() (or after close())")
        return self._ws

    def shell(self) -> Shell:
        """The episode's persistent bash session (the set-up state's, carried by the fork)."""
        if self._shell is None or not self._shell.alive:
            self._shell = self.workspace.shell(cwd=self.task.workdir)
        return self._shell

    # -- skyrl-gym ------------------------------------------------------------------------
    def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        """Fork the set-up state; the prompt is passed through."""
        if self._closed:
            raise RolloutError("BunshinTextEnv is closed")
        t0 = time.monotonic()
        if self._ws is None:
            tpl = self._template if self._template is not None else TEMPLATES.get(self.task)
            self._ws = tpl.fork(1)[0]
            self._shell = rollout_shell(self._ws, self.task.workdir)
        self.chat_history = list(prompt)
        return prompt, {"workspace_id": self._ws.id, "setup_s": time.monotonic() - t0}

    def _parse_action(self, action: str) -> tuple[str, str, list[str]]:
        block = _TOOL.search(action)
        if not block:
            raise ValueError("No <tool>...</tool> block found in action string.")
        inner = _INNER.search(block.group(1).strip())
        if not inner:
            raise ValueError("No valid inner tool tag found inside <tool> block.")
        name = inner.group(1)
        if name not in self.tool_to_toolgroup:
            raise ValueError(f"Tool '{name}' not found in any registered tool group.")
        arg = inner.group(2) if name == "write_file" else inner.group(2).strip()
        return self.tool_to_toolgroup[name], name, [arg]

    def _is_done(self, action: str) -> bool:
        return self.turns >= self.max_turns or ("<solution>" in action and "</solution>" in action)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        self.chat_history.append({"role": "assistant", "content": action})
        if self._is_done(action):
            self.reward = self._verify()
            return BaseTextEnvStepOutput(observations=[], reward=self.reward, done=True,
                                         metadata={"verifier": self.verifier})
        self.tool_group.last = None
        try:
            group, name, args = self._parse_action(action)
            observation = self._execute_tool(group, name, args)
            info: dict[str, Any] = {"tool_group": group, "tool_name": name, "tool_input": args[0]}
        except Exception as e:  # noqa: BLE001 - shown to the model, as skyrl-gym's envs do
            if self._ws is not None and self._ws.closed:
                raise
            self.tool_errors += 1
            observation = f"Error: {e}"
            info = {"tool_group": None, "tool_name": None, "tool_input": "", "error": str(e)}
        last = self.tool_group.last
        if last is not None:
            info.update(exit_code=last.exit_code, timed_out=last.timed_out, duration=last.duration)
        obs = {"role": "user", "content": observation}
        self.chat_history.append(obs)
        return BaseTextEnvStepOutput(observations=[obs], reward=0.0, done=False, metadata=info)

    def _verify(self) -> float:
        """The verifier's reward (bunshin.rl.verify: one that crashes, times out or answers no
        usable value gives 0.0 with the failure in ``self.verifier``, never a lost trajectory)."""
        spec, fn = self.reward_spec, self.reward_spec.get("fn")
        timeout = float(spec.get("timeout", 300))
        if callable(fn):
            def check(ws: Workspace, _traj: object) -> object:
                return fn(ws, self.chat_history)
            verifier = Verifier(check, timeout=timeout)
        else:
            verifier = Verifier(spec["command"], timeout=timeout)
        verdict = verify(verifier, self.workspace, None, self.task.workdir)
        if self.workspace.closed:
            raise RolloutError("BunshinTextEnv: the workspace was closed while it was being verified")
        self.verifier = dataclasses.asdict(verdict)
        return verdict.reward

    def get_metrics(self) -> dict[str, Any]:
        return {"steps": self.turns, "tool_errors": self.tool_errors, "reward": self.reward}

    def close(self) -> None:
        """Close this environment's workspace (idempotent); shared snapshots stay."""
        self._closed = True
        ws, self._ws, self._shell = self._ws, None, None
        if ws is not None:
            ws.close()

    # -- forking --------------------------------------------------------------------------
    def fork(self, n: int = 1) -> list[BunshinTextEnv]:
        """``n`` environments on live forks of this one's workspace, each continuing this
        episode (turns and chat history copied; the persistent shell's state carried)."""
        kids = self.workspace.fork(n)
        out = []
        try:
            for k in kids:
                env = type(self)(self.env_config, {**self.extras, "template": None})
                env._template = self._template
                env._ws = k
                live = {sh.id: sh for sh in k.shells}
                env._shell = live.get(self._shell.id) if self._shell is not None else None
                env.turns, env.tool_errors = self.turns, self.tool_errors
                env.chat_history = copy.deepcopy(self.chat_history)
                out.append(env)
        except BaseException:
            for k in kids:
                k.close()
            raise
        return out


if ENV_ID not in skyrl_gym.registry:
    skyrl_gym.register(id=ENV_ID, entry_point="bunshin.rl.skyrl:BunshinTextEnv")
