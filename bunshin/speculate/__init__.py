"""Speculative tool execution: run calls on forks, keep them if they were right.

* :mod:`.block`: ``with ws.speculate() as spec:`` — commit or roll back a block of calls.
* :mod:`.executor`: :class:`SpeculativeExecutor` — run predicted calls in forks while the
  policy generates; adopt the fork whose call really comes.
* :mod:`.predict`: predictors (``predictor(history) -> list[ToolCall]``), the default one
  reading the prefix cache's trie statistics.
* :mod:`.adopt`: the workspace moves both build on.
"""

from __future__ import annotations

from .block import Speculation
from .errors import SpeculationError

__all__ = ["Speculation", "SpeculationError"]
