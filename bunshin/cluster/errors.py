"""The errors of Bunshin on Ray."""

from __future__ import annotations

from ..errors import BunshinError
from ..rl.types import RolloutError

__all__ = ["ClusterError", "HostLost", "TaskSetupError", "UnknownWorkspace"]


class ClusterError(BunshinError):
    """Bunshin on a Ray cluster could not do what was asked (no host, bad argument)."""


class TaskSetupError(ClusterError, RolloutError):
    """A task's setup failed on a host: its group fails, other groups go on."""


class HostLost(ClusterError):
    """The workspace host (a Ray actor) of a workspace or template is gone (its node died or
    the actor was killed): what it held is gone with it."""


class UnknownWorkspace(ClusterError):
    """No workspace or template of that id on the host: closed, or reclaimed after its owner's
    lease ran out."""
