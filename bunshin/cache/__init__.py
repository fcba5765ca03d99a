"""The tool-prefix cache: workspace states keyed by the tool calls that produced them.

>>> from bunshin.cache import PrefixCache, ToolCall
>>> cache = PrefixCache("/tmp/c.lmdb")                      # doctest: +SKIP
>>> cw = cache.rollout(ws, task_id="task-1")                 # doctest: +SKIP
>>> cw.call("make")                                          # miss: executes, keeps the state  # doctest: +SKIP
>>> cw2 = cache.rollout(other_fork_of_same_base, "task-1")   # doctest: +SKIP
>>> cw2.call("make")                                         # hit: restores, no execution    # doctest: +SKIP

Modules: :mod:`.toolcall` (canonical form, keys), :mod:`.tools` (registry), :mod:`.store`
(LMDB metadata), :mod:`.states` (templates, budget, eviction), :mod:`.prefix` (the cache),
:mod:`.session` (what a rollout calls).
"""

from __future__ import annotations

from .errors import CacheError, CacheFormatError, InvalidToolCall, UnknownTool
from .prefix import CacheStats, PrefixCache, SnapshotPolicy
from .rollout import CachedRollout
from .toolcall import ToolCall, as_tool_call, child_key, root_key
from .tools import ToolContext

__all__ = ["CacheError", "CacheFormatError", "CacheStats", "CachedRollout", "InvalidToolCall",
           "PrefixCache", "SnapshotPolicy", "ToolCall", "ToolContext", "UnknownTool",
           "as_tool_call", "child_key", "root_key"]
