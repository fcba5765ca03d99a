"""What the cluster engine hands back: trajectories that say their group and node, and each
group's outcome."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..rl.types import Trajectory

__all__ = ["ClusterGroup", "ClusterResult", "GroupTrajectory"]


@dataclass
class GroupTrajectory(Trajectory):
    """A :class:`~bunshin.rl.Trajectory` (whose ``group`` says the group it belongs to) with
    the Ray node id of the host that ran it (``start_s``/``end_s`` are that host's monotonic
    clock)."""

    node: str = ""

    @property
    def key(self) -> tuple[str, int, int]:
        """(task id, group, rollout index): unique in one cluster run."""
        return (self.task_id, self.group, self.index)


@dataclass
class ClusterGroup:
    """One group of one task: its trajectories by index, and the error that failed it."""

    task_id: str
    group: int
    group_size: int
    trajectories: list[GroupTrajectory] = field(default_factory=list)
    error: str | None = None

    @property
    def complete(self) -> bool:
        return self.error is None and len(self.trajectories) == self.group_size

    @property
    def nodes(self) -> list[str]:
        """Node ids that ran rollouts of this group (more than one after a host was lost)."""
        return sorted({t.node for t in self.trajectories})


@dataclass
class ClusterResult:
    """Every group of one :meth:`ClusterEngine.run`, and the engine's metrics."""

    groups: dict[tuple[str, int], ClusterGroup]
    metrics: dict[str, Any]

    @property
    def trajectories(self) -> list[GroupTrajectory]:
        return [t for g in self.groups.values() for t in g.trajectories]

    @property
    def errors(self) -> dict[tuple[str, int], str]:
        return {k: g.error for k, g in self.groups.items() if g.error is not None}
