"""BunshinRL: group rollouts of tool-calling agents on forked workspaces.

>>> from bunshin.rl import RolloutEngine, ReplayPolicy, Task      # doctest: +SKIP
>>> eng = RolloutEngine(policy, task, group_size=8, mode="bunshin")  # doctest: +SKIP
>>> group = eng.run()                                               # doctest: +SKIP
>>> batch = BatchEngine(policy, tasks, group_size=8, max_concurrency=32).run()  # doctest: +SKIP

Modules: :mod:`.types` (Task, Verifier, Verdict, History, Turn, Completion, Trajectory, the Policy
protocol), :mod:`.policies` (OpenAIPolicy, ReplayPolicy), :mod:`.engine` (RolloutEngine and its
modes), :mod:`.batch` (BatchEngine: tasks × groups, streamed), :mod:`.verify` (running verifiers),
:mod:`.metrics`
(the memory/CPU sampler), :mod:`.gym` (a gymnasium env), :mod:`.minisweagent` (an environment
for mini-swe-agent), :mod:`.skyrl` (a SkyRL-gym text env), :mod:`.swerex` (a SWE-ReX deployment
and runtime).
"""

from __future__ import annotations

import importlib
from typing import Any

from .types import (
    Completion,
    Final,
    History,
    Policy,
    PolicyError,
    RolloutError,
    Task,
    Trajectory,
    Turn,
    Verdict,
    Verifier,
)

_LAZY = {
    "OpenAIPolicy": "bunshin.rl.policies",
    "ReplayPolicy": "bunshin.rl.policies",
    "RolloutEngine": "bunshin.rl.engine",
    "BatchEngine": "bunshin.rl.batch",
    "BatchResult": "bunshin.rl.batch",
    "GroupResult": "bunshin.rl.engine",
    "MODES": "bunshin.rl.engine",
    "MemorySampler": "bunshin.rl.metrics",
    "WorkspaceEnv": "bunshin.rl.gym",
    "BunshinEnvironment": "bunshin.rl.minisweagent",
    "BunshinTextEnv": "bunshin.rl.skyrl",
    "BunshinDeployment": "bunshin.rl.swerex",
    "BunshinRuntime": "bunshin.rl.swerex",
    "ClusterEngine": "bunshin.cluster.engine",
}

__all__ = ["BatchEngine", "BatchResult", "BunshinDeployment", "BunshinEnvironment",  # noqa: RUF022
           "BunshinRuntime", "BunshinTextEnv", "ClusterEngine", "Completion", "Final", "GroupResult", "History",
           "MODES", "MemorySampler", "OpenAIPolicy", "Policy", "PolicyError", "ReplayPolicy", "RolloutEngine",
           "RolloutError", "Task", "Trajectory", "Turn", "Verdict", "Verifier", "WorkspaceEnv"]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'bunshin.rl' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
