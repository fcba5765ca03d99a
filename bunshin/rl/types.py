"""The vocabulary of rollouts: tasks, turns, histories, trajectories and the policy protocol.

A :class:`Task` says how to build the workspace a rollout starts from (a rootfs and setup tool
calls) and what the agent is asked to do. A policy sees a :class:`History` (the task, which
member of the group it is, and the turns so far) and answers with the next :class:`ToolCall`
or a :class:`Final`. The engine turns each answer into a :class:`Turn` and the whole rollout
into a :class:`Trajectory`. A task's :class:`Verifier` scores the finished rollout's workspace; its
:class:`Verdict` is kept in the trajectory, beside the :class:`Completion` of every model reply
(the messages sent, token ids and logprobs) when the policy records them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..cache.toolcall import ToolCall, as_tool_call
from ..errors import BunshinError

__all__ = ["Completion", "Final", "History", "Policy", "PolicyError", "RolloutError", "Task", "Trajectory",
           "Turn", "Verdict", "Verifier"]


class RolloutError(BunshinError):
    """A rollout could not be run (bad task, bad mode, a setup step failed)."""


class PolicyError(RolloutError):
    """A policy could not produce an action (server unreachable after retries, bad reply)."""


@dataclass(frozen=True)
class Verdict:
    """A verifier's judgement of one rollout.

    ``reward``: what the trainer learns from; ``passed``: whether the check held; ``output``:
    what the check printed (tail kept); ``seconds``: its wall time; ``error``: set when the
    check itself failed (crashed, timed out, returned something unusable, or the rollout had no
    workspace to check), then ``reward`` is the verifier's ``failure_reward`` and ``passed`` False.
    """

    reward: float
    passed: bool
    output: str = ""
    seconds: float = 0.0
    error: str | None = None


VerifierCheck = str | Callable[..., Any]


@dataclass(frozen=True)
class Verifier:
    """How a task's rollouts are scored, in the workspace each one ends in.

    ``check``: a bash command, run in the task's ``workdir``: it passes when it exits 0, and its
    reward is the number on the last line it prints to stdout, else 1.0 when it passed and 0.0
    when not. Or a Python callable ``check(workspace, trajectory)`` (trajectory None when scored
    outside a rollout engine) (a coroutine function is
    awaited) returning a :class:`Verdict`, a bool (passed; reward 1.0 or 0.0), a number (the
    reward; passed when > 0) or a ``(reward, passed)`` pair.

    ``timeout``: seconds the check may take; a command is killed then, a coroutine cancelled, and
    a plain function abandoned (its thread cannot be killed: give it the workspace calls'
    ``timeout=``). A check that crashes or times out gives ``Verdict(failure_reward, False,
    error=...)``, never a lost rollout. ``on_fork``: run the check on a fork of the workspace, so
    what it does (builds, test runs) does not touch the workspace the rollout goes on in.
    """

    check: VerifierCheck
    timeout: float = 60.0
    on_fork: bool = False
    failure_reward: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.check, str) and self.check.strip()) and not callable(self.check):
            raise RolloutError(f"Verifier.check must be a bash command str or a callable(workspace, "
                               f"trajectory), got {self.check!r}")
        t = self.timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise RolloutError(f"Verifier.timeout must be a positive number of seconds, got {t!r}")
        r = self.failure_reward
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
            raise RolloutError(f"Verifier.failure_reward must be a finite number, got {r!r}")


@dataclass(frozen=True)
class Task:
    """What every rollout of a group starts from and is asked to do.

    ``setup`` runs once per workspace built from scratch (every rollout in ``fresh`` mode, once
    per group in the others); ``ready`` is a bash command polled after setup until it exits 0
    (a server listening, a REPL loaded). ``rootfs`` is anything ``Workspace.create`` accepts
    (None: the default host view). ``workdir``: where tool calls run (None: the rootfs image's
    WorkingDir, else /). ``tools`` names the tools the agent may call. ``verifier``
    scores each finished rollout: a :class:`Verifier`, or its ``check`` alone (a bash command or
    a callable) with the default options.
    """

    id: str
    prompt: str
    setup: tuple[ToolCall, ...] = ()
    ready: str | None = None
    rootfs: str | os.PathLike | None = None
    workdir: str | None = None
    max_steps: int = 30
    tools: tuple[str, ...] = ("bash", "read_file", "write_file", "python")
    memory_limit: int | None = None
    verifier: Verifier | VerifierCheck | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise RolloutError(f"Task.id must be a non-empty str, got {self.id!r}")
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or self.max_steps < 1:
            raise RolloutError(f"Task {self.id!r}: max_steps must be an int ≥ 1, got {self.max_steps!r}")
        object.__setattr__(self, "setup", tuple(as_tool_call(c) for c in self.setup))
        object.__setattr__(self, "tools", tuple(self.tools))
        if self.verifier is not None and not isinstance(self.verifier, Verifier):
            object.__setattr__(self, "verifier", Verifier(self.verifier))


@dataclass(frozen=True)
class Final:
    """The policy is done; ``text`` is its answer (may be empty)."""

    text: str = ""


@dataclass(frozen=True)
class Completion:
    """One model reply as a trainer needs it: the request's ``messages`` and ``tools`` exactly as
    sent, the reply (``content``, ``tool_calls`` as the server returned them, ``finish_reason``)
    and, when the policy asked for them, the token ids of the prompt and of the completion and
    each completion token's logprob (``tokens``: their text; ``top_logprobs``: the alternatives,
    token text -> logprob, when asked for). ``usage``: the server's token counts."""

    messages: list[dict]
    tools: list[dict] = field(default_factory=list)
    content: str | None = None
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    tokens: list[str] | None = None
    top_logprobs: list[dict[str, float]] | None = None
    usage: dict[str, int] | None = None


@dataclass(frozen=True)
class Turn:
    """One step: the call, what the agent was shown, and where the time went (seconds).

    ``think_s``: the policy's time to produce the call; ``tool_s``: from asking the workspace to
    having the observation; ``source``: "exec" (ran), "cache" (prefix-cache hit) or
    "speculation" (an adopted speculative fork). ``completion``: the model reply that made
    the call, when the policy records one.
    """

    call: ToolCall
    observation: str
    exit_code: int
    think_s: float = 0.0
    tool_s: float = 0.0
    source: str = "exec"
    completion: Completion | None = None


@dataclass
class History:
    """What a policy sees: the task, which rollout of the group (``index``), the turns so far,
    and which group of a batch (``group``). A policy that keeps its replies appends each one's
    :class:`Completion` to ``completions`` (the rollout engine puts it in the turn it made)."""

    task: Task
    index: int = 0
    turns: list[Turn] = field(default_factory=list)
    group: int = 0
    completions: list[Completion] = field(default_factory=list)

    def calls(self) -> list[ToolCall]:
        """The calls made so far, in order."""
        return [t.call for t in self.turns]


@dataclass
class Trajectory:
    """A finished rollout: its turns, final answer, and timings (seconds, monotonic clock).

    ``verdict``: the task's verifier's judgement (None when the task has none); ``completions``:
    every model reply the policy recorded, in order (the final answer's last); ``group``: which
    group of a batch it belongs to.
    """

    task_id: str
    index: int
    mode: str
    turns: list[Turn]
    final: Final | None
    start_s: float
    end_s: float
    setup_s: float = 0.0
    error: str | None = None
    verdict: Verdict | None = None
    completions: list[Completion] = field(default_factory=list)
    group: int = 0

    @property
    def reward(self) -> float | None:
        """The verdict's reward (None without a verifier)."""
        return self.verdict.reward if self.verdict is not None else None

    @property
    def latency_s(self) -> float:
        """Wall time of the rollout, workspace acquisition included."""
        return self.end_s - self.start_s

    @property
    def tool_s(self) -> float:
        return sum(t.tool_s for t in self.turns)

    @property
    def think_s(self) -> float:
        return sum(t.think_s for t in self.turns)


@runtime_checkable
class Policy(Protocol):
    """Anything with ``async def act(history) -> ToolCall | Final``."""

    async def act(self, history: History) -> ToolCall | Final: ...
