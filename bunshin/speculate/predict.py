"""Predictors: ``predictor(history) -> list[ToolCall]``, best guess first.

``history`` is the list of :class:`~bunshin.cache.ToolCall` the rollout made so far. Any
callable with that signature works; :class:`TriePredictor` is the default one, reading the
prefix cache's visit counts: the most-visited children of the node ``history`` leads to.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..cache.toolcall import ToolCall, as_tool_call, child_key, root_key
from .errors import SpeculationError

if TYPE_CHECKING:
    from ..cache.prefix import PrefixCache

__all__ = ["Predictor", "TriePredictor"]

Predictor = Callable[[Sequence[ToolCall]], Sequence[ToolCall | str]]


class TriePredictor:
    """Predict from trie statistics: the children of ``task_id``'s node for ``history``,
    most visited first (ties: the call's canonical form), at most ``top``."""

    def __init__(self, cache: PrefixCache, task_id: str, *, top: int = 4) -> None:
        if isinstance(top, bool) or not isinstance(top, int) or top < 1:
            raise SpeculationError(f"top must be an int ≥ 1, got {top!r}")
        self.cache = cache
        self.root = root_key(task_id)
        self.top = top

    def node(self, history: Sequence[ToolCall | str]) -> bytes:
        """The trie key ``history`` leads to from the task's root."""
        key = self.root
        for c in history:
            key = child_key(key, as_tool_call(c))
        return key

    def __call__(self, history: Sequence[ToolCall | str]) -> list[ToolCall]:
        rec = self.cache.store.get(self.node(history))
        if rec is None:
            return []
        kids = []
        for hexkey, visits in rec["children"].items():
            child = self.cache.store.get(bytes.fromhex(hexkey))
            if child is None or child.get("call") is None:
                continue
            name, args = json.loads(child["call"])
            kids.append((-visits, child["call"], ToolCall(name, args)))
        kids.sort(key=lambda k: (k[0], k[1]))
        return [tc for _, _, tc in kids[: self.top]]
