"""Where Bunshin keeps things, read once from the environment.

``BUNSHIN_STATE_DIR`` (default ``/var/lib/bunshin``): live workspaces' upper layers and metadata.
``BUNSHIN_CACHE_DIR`` (default ``$XDG_CACHE_HOME/bunshin`` or ``~/.cache/bunshin``): extracted
rootfs layers, built Debian roots, kernel probe results, a provisioned CRIU.
``BUNSHIN_CGROUP_PREFIX`` (default ``bunshin``): the cgroup directory every workspace lives under.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["state_dir", "cache_dir", "cgroup_prefix"]


def state_dir() -> Path:
    """Directory holding live workspaces (``<state>/ws/<id>``)."""
    return Path(os.environ.get("BUNSHIN_STATE_DIR", "/var/lib/bunshin"))


def cache_dir() -> Path:
    """Directory for caches that survive restarts (layers, Debian roots, probes)."""
    env = os.environ.get("BUNSHIN_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "bunshin"


def cgroup_prefix() -> str:
    """Name of the cgroup directory (in every hierarchy) that holds all workspaces."""
    return os.environ.get("BUNSHIN_CGROUP_PREFIX", "bunshin")
