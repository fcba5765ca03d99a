"""Workspace cgroups: limits, accounting, freezing and killing, on cgroup v1 or v2.

>>> cg = backend().create("ws-1", memory_limit="512M", pids_limit=256)
>>> cg.procs_files()          # the workspace's init writes "0" into each
>>> cg.freeze(); cg.thaw(); cg.stats(); cg.destroy()

:func:`backend` picks cgroup v2 when the host's unified hierarchy offers the memory and pids
controllers, else v1. ``BUNSHIN_CGROUP=v1`` or ``v2`` forces one (UnsupportedKernel if that
version is not mounted). Limit forms are documented in :mod:`bunshin.runtime.cgroup.limits`.
"""

from __future__ import annotations

import functools

from ... import config
from ...errors import CgroupError, UnsupportedKernel
from . import dynmods
from .base import CONTROLLERS, Cgroup, CgroupBackend, CgroupStats
from .limits import MIN_MEMORY, parse_cpu, parse_memory, parse_pids
from .v1 import V1Backend, V1Cgroup
from .v2 import V2Backend, V2Cgroup

__all__ = [
    "CONTROLLERS",
    "MIN_MEMORY",
    "Cgroup",
    "CgroupBackend",
    "CgroupStats",
    "V1Backend",
    "V1Cgroup",
    "V2Backend",
    "V2Cgroup",
    "backend",
    "parse_cpu",
    "parse_memory",
    "parse_pids",
]


def backend() -> CgroupBackend:
    """The cgroup backend for this host, chosen once (per value of ``BUNSHIN_CGROUP``)."""
    return _select(config.cgroup_version())


@functools.cache
def _select(forced: str) -> CgroupBackend:
    dynmods.ensure()  # before the first task moves: see dynmods.py (10-25 ms per fork otherwise)
    if forced == "v1":
        return V1Backend()
    if forced == "v2":
        return V2Backend()
    if forced:
        raise CgroupError(f"BUNSHIN_CGROUP={forced!r}: expected 'v1' or 'v2', or leave it unset")
    try:
        v2 = V2Backend()
        if {"memory", "pids"} <= v2.available():
            return v2
    except UnsupportedKernel:
        pass
    try:
        return V1Backend()
    except UnsupportedKernel as e:
        raise UnsupportedKernel(
            "no usable cgroups: the unified (v2) hierarchy lacks the memory and pids "
            f"controllers and {e}"
        ) from None
