"""BunshinRL: group rollouts of tool-calling agents on forked workspaces.

>>> from bunshin.rl import RolloutEngine, ReplayPolicy, Task      # doctest: +SKIP
>>> eng = RolloutEngine(policy, task, group_size=8, mode="bunshin")  # doctest: +SKIP
>>> group = eng.run()                                               # doctest: +SKIP

Modules: :mod:`.types` (Task, History, Turn, Trajectory, the Policy protocol), :mod:`.policies`
(OpenAIPolicy, ReplayPolicy), :mod:`.engine` (RolloutEngine and its modes), :mod:`.metrics`
(the memory/CPU sampler), :mod:`.gym` (a gymnasium env), :mod:`.minisweagent` (an environment
for mini-swe-agent).
"""

from __future__ import annotations

import importlib
from typing import Any

from .types import (
    Final,
    History,
    Policy,
    PolicyError,
    RolloutError,
    Task,
    Trajectory,
    Turn,
)

_LAZY = {
    "OpenAIPolicy": "bunshin.rl.policies",
    "ReplayPolicy": "bunshin.rl.policies",
    "RolloutEngine": "bunshin.rl.engine",
    "GroupResult": "bunshin.rl.engine",
    "MODES": "bunshin.rl.engine",
    "MemorySampler": "bunshin.rl.metrics",
    "WorkspaceEnv": "bunshin.rl.gym",
    "BunshinEnvironment": "bunshin.rl.minisweagent",
    "ClusterEngine": "bunshin.cluster.engine",
}

__all__ = ["BunshinEnvironment", "ClusterEngine", "Final", "GroupResult", "History", "MODES", "MemorySampler",  # noqa: RUF022
           "OpenAIPolicy", "Policy", "PolicyError", "ReplayPolicy", "RolloutEngine", "RolloutError", "Task",
           "Trajectory", "Turn", "WorkspaceEnv"]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'bunshin.rl' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
