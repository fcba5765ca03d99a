"""Bunshin: fork live Linux workspaces for agentic reinforcement learning.

>>> import bunshin
>>> with bunshin.Workspace.create() as ws:
...     ws.run("echo hi").stdout
b'hi\\n'

Submodules are imported lazily so that ``import bunshin`` stays cheap in a trainer.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import *  # noqa: F403
from .errors import __all__ as _errors_all

__version__ = "0.1.0"

_LAZY = {
    "Workspace": "bunshin.runtime.workspace",
    "Result": "bunshin.runtime.result",
    "Shell": "bunshin.runtime.shell",
    "Template": "bunshin.runtime.template",
    "PrefixCache": "bunshin.cache.prefix",
    "ToolCall": "bunshin.cache.toolcall",
    "SpeculativeExecutor": "bunshin.speculate.executor",
}

__all__ = ["__version__", *_errors_all, *_LAZY]


def __getattr__(name: str) -> Any:
    if name == "memory":
        return importlib.import_module("bunshin.memory")
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'bunshin' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
