"""``PrefixCache``: workspace states keyed by tool-call prefix.

>>> cache = PrefixCache("/tmp/cache.lmdb", memory_budget=512 << 20)   # doctest: +SKIP
>>> cw = cache.rollout(ws, task_id="repo-42")                          # doctest: +SKIP
>>> cw.call("pip install -e /repo")     # a miss: executes, records, snapshots   # doctest: +SKIP

Sessions of one ``task_id`` must start from the same workspace state (forks of one base, as in
a group rollout): the cache cannot check it, and a hit replaces the session's state with the
cached one. Metadata (visit counts, results, costs) is shared through LMDB by every process;
live states are templates of this process only, so other processes see hits only for the
metadata (they execute and snapshot on their own).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Self

from ..errors import BunshinError, ForkError
from ..runtime.result import Result
from .errors import CacheError
from .states import State, StateTable
from .store import MetaStore
from .toolcall import ToolCall
from .tools import BUILTIN_TOOLS, ToolFn

if TYPE_CHECKING:
    from ..runtime.workspace import Workspace
    from .rollout import CachedRollout

log = logging.getLogger("bunshin.cache")

__all__ = ["CacheStats", "PrefixCache", "SnapshotPolicy"]


@dataclass
class Spilled:
    """A state evicted to disk: its image directory and what a hit returns."""

    path: Path
    parent: bytes
    shell: tuple[int, str] | None
    result: Result
    exec_time: float

SnapshotPolicy = float | Callable[[ToolCall, Result], bool]
"""When to keep a state after a miss: calls that took at least this many seconds (0: every
call), or ``policy(call, result) -> bool``."""


@dataclass
class CacheStats:
    """Counters of one ``PrefixCache`` (this process)."""

    hits: int = 0            # calls answered from a live state, without execution
    misses: int = 0          # cacheable calls that executed
    waits: int = 0           # calls that waited for another session executing the same node
    uncacheable: int = 0     # calls executed outside the trie (predicate, or after leaving it)
    snapshots: int = 0       # states kept
    snapshot_failures: int = 0  # snapshots refused (e.g. pid-namespace depth): state not kept
    snapshot_seconds: float = 0.0  # time spent taking snapshots (freeze, plan, fork back)
    evictions: int = 0       # states closed to fit the budget
    spills: int = 0          # evicted states written to ``spill_dir`` (CRIU) before closing
    unspills: int = 0        # spilled states restored on a hit
    verified: int = 0        # hits re-executed to check them
    mismatches: int = 0      # verified hits whose fresh result differed from the recorded one
    saved_seconds: float = 0.0  # recorded execution time of the hits


class PrefixCache:
    """A trie of workspace states over canonical tool calls.

    ``path``: the LMDB file (created if missing; an existing file must be a Bunshin cache —
    otherwise :class:`CacheFormatError`, file untouched). ``memory_budget``: bytes of live
    states kept (see :mod:`bunshin.cache.states`). ``snapshot``: the :data:`SnapshotPolicy`.
    ``cacheable(call) -> bool``: False marks calls never cached (network, clock): they execute,
    and the session then leaves the trie (its state no longer follows from its prefix).
    ``verify``: the fraction of hits re-executed instead, comparing stdout, stderr and exit code
    with the record (``stats.verified``/``stats.mismatches``); a verified hit keeps the freshly
    executed state. ``record_limit``: bytes of each stream recorded; a node whose output was
    longer keeps no state (a hit could not return its whole output). ``seed`` seeds the verify
    sampler. ``spill_dir``: where evicted states go (CRIU images, one directory per node, see
    :mod:`bunshin.criu`) to be restored on a hit instead of re-executed; None: evicted states
    are closed. Spilled states belong to this cache object: ``close()`` removes them.
    """

    def __init__(self, path: str | os.PathLike, *, memory_budget: int = 1 << 30,
                 snapshot: SnapshotPolicy = 0.0, cacheable: Callable[[ToolCall], bool] | None = None,
                 verify: float = 0.0, record_limit: int = 1 << 20, seed: int | None = None,
                 spill_dir: str | os.PathLike | None = None) -> None:
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget < 0:
            raise CacheError(f"memory_budget must be an int ≥ 0 (bytes), got {memory_budget!r}")
        if not callable(snapshot) and (isinstance(snapshot, bool) or not isinstance(snapshot, (int, float))
                                       or snapshot < 0):
            raise CacheError(f"snapshot must be seconds ≥ 0 or a callable(call, result), got {snapshot!r}")
        if cacheable is not None and not callable(cacheable):
            raise CacheError(f"cacheable must be a callable(call) -> bool, got {cacheable!r}")
        if isinstance(verify, bool) or not isinstance(verify, (int, float)) or not 0 <= verify <= 1:
            raise CacheError(f"verify must be a fraction in [0, 1], got {verify!r}")
        if isinstance(record_limit, bool) or not isinstance(record_limit, int) or record_limit < 0:
            raise CacheError(f"record_limit must be an int ≥ 0 (bytes), got {record_limit!r}")
        self.store = MetaStore(path)
        self.tools: dict[str, ToolFn] = dict(BUILTIN_TOOLS)
        self.snapshot_policy = snapshot
        self.cacheable = cacheable
        self.verify = float(verify)
        self.record_limit = record_limit
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self._states = StateTable(memory_budget)
        self._inflight: set[bytes] = set()
        self._stats = CacheStats()
        self._closed = False
        self.spill_dir = Path(spill_dir) if spill_dir is not None else None
        self._spilled: dict[bytes, Spilled] = {}
        if self.spill_dir is not None:
            self.spill_dir.mkdir(parents=True, exist_ok=True)

    # -- configuration ------------------------------------------------------------------
    def register_tool(self, name: str, fn: ToolFn, *, replace: bool = False) -> None:
        """Add tool ``name``: ``fn(ctx, **args)`` (see :mod:`bunshin.cache.tools`)."""
        if not isinstance(name, str) or not name:
            raise CacheError(f"tool name must be a non-empty str, got {name!r}")
        if not callable(fn):
            raise CacheError(f"tool {name!r}: fn must be callable, got {fn!r}")
        if name in self.tools and not replace:
            raise CacheError(f"tool {name!r} is already registered; pass replace=True to replace it")
        self.tools[name] = fn

    def rollout(self, ws: Workspace, task_id: str) -> CachedRollout:
        """A session driving ``ws`` through the cache, at the root of ``task_id``'s trie."""
        from .rollout import CachedRollout

        self.check_open()
        return CachedRollout(self, ws, task_id)

    # -- state --------------------------------------------------------------------------
    @property
    def stats(self) -> CacheStats:
        """A copy of the counters."""
        with self._cond:
            return dataclasses.replace(self._stats)

    @property
    def memory_used(self) -> int:
        """Bytes of live states (their measured cost)."""
        with self._cond:
            return self._states.used

    def live_states(self) -> list[bytes]:
        """Node keys that have a live template in this process."""
        with self._cond:
            return list(self._states.states)

    def spill(self, node: bytes) -> None:
        """Write node ``node``'s live state to ``spill_dir`` through CRIU and drop it from
        memory; a later hit restores it (``Template.load``)."""
        if self.spill_dir is None:
            raise CacheError("this cache has no spill_dir; pass PrefixCache(..., spill_dir=...)")
        with self._cond:
            self.check_open()
            st = self._states.get(node)
            if st is None or st.pins:
                raise CacheError(f"node {node.hex()} has no live state to spill (or it is in use)")
            self._states.remove(node)
        self._evict([st])

    def spilled_states(self) -> list[bytes]:
        """Node keys whose state is on disk (``spill_dir``), not in memory."""
        with self._cond:
            return [k for k in self._spilled if k not in self._states.states]

    def close(self) -> None:
        """Close every live state and the LMDB environment."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            states = list(self._states.states.values())
            self._states.states.clear()
            self._states.used = 0
            self._cond.notify_all()
        for st in states:
            st.template.close()
            self._mark_template(st.key, None)
        for k, sp in list(self._spilled.items()):
            shutil.rmtree(sp.path, ignore_errors=True)
            self._mark_template(k, None)
        self._spilled.clear()
        self.store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- used by sessions (session.py) -------------------------------------------------
    def claim(self, key: bytes) -> tuple[State | None, bool]:
        """(node ``key``'s state, pinned once, or None; whether the caller now owns the node's
        execution and must :meth:`release` it). Waits while another session executes it; a
        spilled state is restored here."""
        waited = False
        with self._cond:
            while True:
                self.check_open()
                st = self._states.get(key)
                if st is not None:
                    st.pins += 1
                    return st, False
                if key in self._inflight and not waited:
                    self._stats.waits += 1
                    waited = True
                    self._cond.wait_for(lambda: key not in self._inflight or self._closed)
                    continue
                if waited:
                    return None, False
                self._inflight.add(key)
                break
        if key in self._spilled:
            st = self.unspill(key)  # on disk: restore it rather than execute
            if st is not None:
                self.release(key)
                return st, False
        return None, True

    def release(self, key: bytes) -> None:
        """The owner of node ``key``'s execution (:meth:`claim`) is done with it."""
        with self._cond:
            self._inflight.discard(key)
            self._cond.notify_all()

    def unpin(self, st: State) -> None:
        """A session is done with a state :meth:`claim` pinned."""
        with self._cond:
            st.pins -= 1

    def check_open(self) -> None:
        """CacheError once the cache is closed."""
        if self._closed:
            raise CacheError(f"prefix cache {self.store.path} is closed")

    def count(self, **inc: float) -> None:
        """Add ``inc`` to the :class:`CacheStats` counters of those names."""
        with self._cond:
            for k, v in inc.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)

    def is_cacheable(self, call: ToolCall) -> bool:
        """Whether ``call`` may be answered from, and recorded in, the cache."""
        return self.cacheable is None or bool(self.cacheable(call))

    def wants_snapshot(self, call: ToolCall, r: Result, dt: float) -> bool:
        """Whether the policy keeps the state after ``call`` (result ``r``, ``dt`` s)."""
        p = self.snapshot_policy
        return bool(p(call, r)) if callable(p) else dt >= p

    def sample_verify(self) -> bool:
        """Whether this hit is one of the ``verify`` share re-executed and compared."""
        with self._cond:
            return self.verify > 0 and self._rng.random() < self.verify

    def _mark_template(self, key: bytes, holder: str | None, cost: int | None = None) -> None:
        def fn(rec: dict) -> None:
            rec["template"] = holder
            if cost is not None:
                rec["mem_cost"] = cost
        try:
            self.store.update(key, fn)
        except CacheError as e:  # closed meanwhile: the record says less, nothing is lost
            log.debug("cache: %s", e)

    def admit(self, st: State, *, new: bool = True) -> None:
        """Keep ``st`` and evict whatever no longer fits the budget. ``new``: a fresh snapshot
        (counted), not a state restored from ``spill_dir``."""
        with self._cond:
            if self._closed:
                st.template.close()
                return
            self._states.add(st)
            self._stats.snapshots += new
            victims = self._states.over_budget(self.store.reuse_probability)
            self._stats.evictions += len(victims)
        if all(v is not st for v in victims):
            self._mark_template(st.key, f"{os.getpid()}:{st.template.id}", st.cost)
        self._evict(victims)

    def _evict(self, victims: list[State]) -> None:
        """Spill (when there is a ``spill_dir`` and the state is not on disk yet) and close."""
        for v in victims:
            spilled = v.key in self._spilled
            if self.spill_dir is not None and not spilled:
                path = self.spill_dir / v.key.hex()
                try:
                    v.template.save(path)
                    spilled = True
                    with self._cond:
                        self._spilled[v.key] = Spilled(path, v.parent, v.shell, v.result, v.exec_time)
                        self._stats.spills += 1
                except BunshinError as e:
                    log.info("cache: state %s not spilled: %s", v.key.hex()[:12], e)
            v.template.close()
            holder = f"criu:{self._spilled[v.key].path}" if spilled else None
            self._mark_template(v.key, holder)

    def unspill(self, key: bytes) -> State | None:
        """Restore the spilled state of ``key`` into memory, pinned once; None if it fails
        (the caller then executes). The caller holds ``key`` in ``_inflight``."""
        from ..runtime.template import Template
        from .states import template_cost

        sp = self._spilled.get(key)
        if sp is None:
            return None
        try:
            tpl = Template.load(sp.path)
        except BunshinError as e:
            log.warning("cache: spilled state %s cannot be restored: %s", key.hex()[:12], e)
            with self._cond:
                self._spilled.pop(key, None)
            shutil.rmtree(sp.path, ignore_errors=True)
            return None
        try:
            cost = template_cost(tpl)
        except BaseException:
            tpl.close()
            raise
        st = State(key=key, parent=sp.parent, template=tpl, shell=sp.shell, result=sp.result,
                   exec_time=sp.exec_time, cost=cost, pins=1)
        self.count(unspills=1)
        self.admit(st, new=False)
        return st

    def snapshot_of(self, ws: Workspace):
        """``ws.snapshot()``, timed and counted; None (logged) where it cannot be forked."""
        t = time.monotonic()
        try:
            tpl = ws.snapshot()
            self.count(snapshot_seconds=time.monotonic() - t)
            return tpl
        except ForkError as e:
            log.info("cache: state not kept: %s", e)
            self.count(snapshot_failures=1)
            return None
