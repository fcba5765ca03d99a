"""The vocabulary of rollouts: tasks, turns, histories, trajectories and the policy protocol.

A :class:`Task` says how to build the workspace a rollout starts from (a rootfs and setup tool
calls) and what the agent is asked to do. A policy sees a :class:`History` (the task, which
member of the group it is, and the turns so far) and answers with the next :class:`ToolCall`
or a :class:`Final`. The engine turns each answer into a :class:`Turn` and the whole rollout
into a :class:`Trajectory`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ..cache.toolcall import ToolCall, as_tool_call
from ..errors import BunshinError

__all__ = ["Final", "History", "Policy", "PolicyError", "RolloutError", "Task", "Trajectory",
           "Turn"]


class RolloutError(BunshinError):
    """A rollout could not be run (bad task, bad mode, a setup step failed)."""


class PolicyError(RolloutError):
    """A policy could not produce an action (server unreachable after retries, bad reply)."""


@dataclass(frozen=True)
class Task:
    """What every rollout of a group starts from and is asked to do.

    ``setup`` runs once per workspace built from scratch (every rollout in ``fresh`` mode, once
    per group in the others); ``ready`` is a bash command polled after setup until it exits 0
    (a server listening, a REPL loaded). ``rootfs`` is anything ``Workspace.create`` accepts
    (None: the default host view). ``tools`` names the tools the agent may call.
    """

    id: str
    prompt: str
    setup: tuple[ToolCall, ...] = ()
    ready: str | None = None
    rootfs: str | os.PathLike | None = None
    workdir: str = "/"
    max_steps: int = 30
    tools: tuple[str, ...] = ("bash", "read_file", "write_file", "python")
    memory_limit: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise RolloutError(f"Task.id must be a non-empty str, got {self.id!r}")
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or self.max_steps < 1:
            raise RolloutError(f"Task {self.id!r}: max_steps must be an int ≥ 1, got {self.max_steps!r}")
        object.__setattr__(self, "setup", tuple(as_tool_call(c) for c in self.setup))
        object.__setattr__(self, "tools", tuple(self.tools))


@dataclass(frozen=True)
class Final:
    """The policy is done; ``text`` is its answer (may be empty)."""

    text: str = ""


@dataclass(frozen=True)
class Turn:
    """One step: the call, what the agent was shown, and where the time went (seconds).

    ``think_s``: the policy's time to produce the call; ``tool_s``: from asking the workspace to
    having the observation; ``source``: "exec" (ran), "cache" (prefix-cache hit) or
    "speculation" (an adopted speculative fork).
    """

    call: ToolCall
    observation: str
    exit_code: int
    think_s: float = 0.0
    tool_s: float = 0.0
    source: str = "exec"


@dataclass
class History:
    """What a policy sees: the task, which rollout of the group (``index``), the turns so far."""

    task: Task
    index: int = 0
    turns: list[Turn] = field(default_factory=list)

    def calls(self) -> list[ToolCall]:
        """The calls made so far, in order."""
        return [t.call for t in self.turns]


@dataclass
class Trajectory:
    """A finished rollout: its turns, final answer, and timings (seconds, monotonic clock)."""

    task_id: str
    index: int
    mode: str
    turns: list[Turn]
    final: Final | None
    start_s: float
    end_s: float
    setup_s: float = 0.0
    error: str | None = None

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
