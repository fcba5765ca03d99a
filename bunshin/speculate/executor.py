"""``SpeculativeExecutor``: run predicted tool calls on forks while the policy generates.

>>> ex = SpeculativeExecutor(predictor, max_inflight=2)       # doctest: +SKIP
>>> ex.prefetch(ws, history)        # forks ws, runs the top predicted calls in the background
>>> r = ex.call(ws, real_call)      # hit: ws adopts that fork, no second execution

``target`` (``ws`` above) is a :class:`~bunshin.Workspace` or a
:class:`~bunshin.cache.CachedRollout`. Bash calls run in the target's shell (the session's
shell, or the workspace's first live shell); each fork continues that shell's copy.

A hit makes ws *adopt* the fork (the same ``Workspace`` and ``Shell`` objects continue in its
state, nothing runs twice); a miss closes every fork and executes the call normally. Calls the
cacheable predicate rejects (network, clock) are never speculated: the session's cache
predicate, else ``cacheable=``, else the predictor's cache's. If ws was used between
``prefetch`` and ``call`` (anything that used CPU in it or wrote a file), the forks are stale:
they are discarded and the call executes. Each prefetch forks ws (``ws.fork``: ws runs on
untouched); a hit moves ws one pid namespace deeper (32 at most, then the next fork moves ws
back to the top through CRIU first); where it cannot, prefetch declines (``stats.declined``)
and calls run normally.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Self, Union

from ..cache.rollout import CachedRollout
from ..cache.toolcall import ToolCall, as_tool_call, child_key
from ..cache.tools import BUILTIN_TOOLS, ToolContext, ToolFn, run_tool
from ..errors import ForkError
from ..runtime.workspace import Workspace
from .adopt import adopt, mark, unchanged
from .branch import Branch, shell_in
from .errors import SpeculationError
from .predict import Predictor

if TYPE_CHECKING:
    from ..runtime.result import Result

log = logging.getLogger("bunshin.speculate")

__all__ = ["SpecStats", "SpeculativeExecutor"]

Target = Union["Workspace", CachedRollout]


@dataclass
class SpecStats:
    """Counters of one executor."""

    hits: int = 0                   # real calls answered by an adopted fork
    misses: int = 0                 # real calls that arrived while no branch had predicted them
    speculated: int = 0             # branches started
    skipped: int = 0                # predictions not run: non-cacheable, or beyond max_inflight
    declined: int = 0               # prefetches that could not fork (pid-namespace depth)
    wasted_cpu_seconds: float = 0.0  # CPU used by discarded branches' forks
    saved_seconds: float = 0.0      # execution time of hits minus the time spent waiting for them


@dataclass
class _Pending:
    branches: list[Branch]


class SpeculativeExecutor:
    """Speculate with ``predictor(history) -> list[ToolCall]``, at most ``max_inflight`` forks
    per workspace. ``tools``: the tool registry for plain workspaces (a session uses its
    cache's). ``cacheable(call) -> bool``: see the module doc."""

    def __init__(self, predictor: Predictor, *, max_inflight: int = 2,
                 tools: Mapping[str, ToolFn] | None = None,
                 cacheable: Callable[[ToolCall], bool] | None = None) -> None:
        if not callable(predictor):
            raise SpeculationError(f"predictor must be callable(history) -> list[ToolCall], got {predictor!r}")
        if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1:
            raise SpeculationError(f"max_inflight must be an int ≥ 1 (forks per workspace), got {max_inflight!r}")
        if cacheable is not None and not callable(cacheable):
            raise SpeculationError(f"cacheable must be a callable(call) -> bool, got {cacheable!r}")
        self.predictor = predictor
        self.max_inflight = max_inflight
        self.tools = dict(BUILTIN_TOOLS if tools is None else tools)
        self.cacheable = cacheable
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}  # id(ws) -> its branches
        self._stats = SpecStats()

    @property
    def stats(self) -> SpecStats:
        """A copy of the counters."""
        with self._lock:
            return replace(self._stats)

    # -- targets --------------------------------------------------------------------------
    def _parts(self, target: Target) -> tuple[Workspace, Mapping[str, ToolFn], int | None]:
        if isinstance(target, CachedRollout):
            sh = target._shell
            return target.ws, target.cache.tools, sh.pid if sh is not None and sh.alive else None
        if isinstance(target, Workspace):
            live = [s for s in target.shells if s.alive]
            return target, self.tools, live[0].pid if live else None
        raise SpeculationError(f"target must be a Workspace or a CachedRollout, got {type(target).__name__}")

    def _is_cacheable(self, target: Target, call: ToolCall) -> bool:
        if isinstance(target, CachedRollout):
            return target.cache.is_cacheable(call)
        if self.cacheable is not None:
            return bool(self.cacheable(call))
        cache = getattr(self.predictor, "cache", None)
        return cache is None or cache.is_cacheable(call)

    # -- speculation ----------------------------------------------------------------------
    def prefetch(self, target: Target, history: Sequence[ToolCall | str] = ()) -> list[ToolCall]:
        """Start the top predicted calls for ``target`` on forks; returns the calls started.
        Branches of an earlier prefetch for the same workspace are discarded first."""
        ws, tools, shell_pid = self._parts(target)
        self.discard(ws)
        preds = self.predictor([as_tool_call(c) for c in history])
        if isinstance(preds, (str, ToolCall)) or not isinstance(preds, Sequence):
            raise SpeculationError(f"the predictor must return a list of ToolCall, got {preds!r}")
        calls: list[ToolCall] = []
        skipped = 0
        for p in preds:
            tc = as_tool_call(p)
            if tc in calls:
                continue
            if tc.name not in tools or not self._is_cacheable(target, tc) or len(calls) == self.max_inflight:
                skipped += 1
                continue
            calls.append(tc)
        self._count(skipped=skipped)
        if not calls:
            return []
        try:
            kids = ws.fork(len(calls))
        except ForkError as e:
            log.info("speculate: not speculating: %s", e)
            self._count(declined=1)
            return []
        mark(ws)
        branches = [Branch(c, k, tools, shell_pid) for c, k in zip(calls, kids)]
        with self._lock:
            self._pending[id(ws)] = _Pending(branches)
            self._stats.speculated += len(branches)
        return calls

    def call(self, target: Target, call: ToolCall | str) -> Result:
        """The real call: adopt the branch that ran it, else discard all and execute it."""
        tc = as_tool_call(call)
        ws, tools, shell_pid = self._parts(target)
        with self._lock:
            pend = self._pending.pop(id(ws), None)
        if pend is not None:
            hit = next((b for b in pend.branches if b.call == tc), None)
            if hit is not None:
                waited = hit.join()
                if hit.error is None and unchanged(ws):
                    return self._adopt(target, ws, pend, hit, waited)
            self._drop(pend)
            self._count(misses=1)
        if isinstance(target, CachedRollout):
            return target.call(tc)
        return run_tool(tools, ToolContext(ws, lambda: shell_in(ws, shell_pid)), tc)

    def _adopt(self, target: Target, ws: Workspace, pend: _Pending, hit: Branch, waited: float) -> Result:
        others = [b for b in pend.branches if b is not hit]
        wasted = sum(b.discard() for b in others)
        adopt(ws, hit.kid)
        self._count(hits=1, wasted_cpu_seconds=wasted, saved_seconds=max(hit.exec_time - waited, 0.0))
        assert hit.result is not None
        if isinstance(target, CachedRollout):
            _record(target, hit, hit.result)
        return hit.result

    def _drop(self, pend: _Pending) -> None:
        wasted = sum(b.discard() for b in pend.branches)
        self._count(wasted_cpu_seconds=wasted)

    def discard(self, target: Target) -> None:
        """Close the branches pending for ``target``'s workspace (if any)."""
        ws = target.ws if isinstance(target, CachedRollout) else target
        with self._lock:
            pend = self._pending.pop(id(ws), None)
        if pend is not None:
            self._drop(pend)

    def close(self) -> None:
        """Discard every pending branch."""
        with self._lock:
            pends = list(self._pending.values())
            self._pending.clear()
        for p in pends:
            self._drop(p)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _count(self, **inc: float) -> None:
        with self._lock:
            for k, v in inc.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)


def _record(session: CachedRollout, hit: Branch, result: Result) -> None:
    """Keep the session's trie position and shell after a hit, as if it had executed."""
    from ..cache.store import encode_result

    session.last_source = "speculation"
    sh = session._shell
    if sh is None or not sh.alive:
        live = [s for s in session.ws.shells if s.alive]
        session._shell = live[0] if live else None
    cache, parent = session.cache, session.key
    if parent is None or not cache.is_cacheable(hit.call):
        session.key = None
        return
    key = child_key(parent, hit.call)
    cache.store.visit(parent, key, hit.call.canonical)
    rec = encode_result(result, cache.record_limit)

    def fn(d: dict) -> None:
        d["result"], d["exec_time"] = rec, hit.exec_time
    cache.store.update(key, fn)
    session.key = key
