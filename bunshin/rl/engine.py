"""``RolloutEngine``: run a group of rollouts of one task, concurrently, in one of four modes.

>>> eng = RolloutEngine(ReplayPolicy(traces, think_s=0.5), task, group_size=8, mode="bunshin")  # doctest: +SKIP
>>> g = eng.run()                                                 # doctest: +SKIP
>>> g.latency_s, g.memory.peak_bytes, g.trajectories[0].turns     # doctest: +SKIP

Modes (see :mod:`bunshin.rl.workspaces` for where workspaces come from):

========== ============================================ ===== ===========
mode       workspace per rollout                        cache speculation
========== ============================================ ===== ===========
fresh      new workspace, setup replayed                no    no
criu       CRIU restore of the set-up workspace         no    no
fork       live fork of the set-up workspace            no    no
bunshin    live fork                                    yes   yes
========== ============================================ ===== ===========

``cache``/``speculate`` switch the two features in ``fork``/``bunshin`` mode. Rollouts run as
asyncio tasks (the policy is async); workspace work runs on a thread pool, at most
``concurrency`` rollouts at a time. A rollout that fails keeps its error in its trajectory and
the group goes on; a setup that fails raises :class:`RolloutError`. A task's verifier scores each
rollout in its final workspace before that is closed (``Trajectory.verdict``; see
:mod:`bunshin.rl.verify`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from ..cache.toolcall import ToolCall, as_tool_call, child_key
from ..cache.tools import BUILTIN_TOOLS, ToolContext, arun_tool, run_tool
from .metrics import CpuMeter, MemoryReport, MemorySampler
from .types import Final, History, Policy, RolloutError, Task, Trajectory, Turn, Verifier
from .verify import averify
from .workspaces import provider

if TYPE_CHECKING:
    from ..cache.prefix import PrefixCache
    from ..runtime.result import Result

log = logging.getLogger("bunshin.rl")

__all__ = ["MODES", "GroupResult", "RolloutEngine"]

MODES = ("fresh", "criu", "fork", "bunshin")
OBSERVATION_LIMIT = 16 << 10
"""Characters of a call's output an agent is shown (head and tail kept)."""


def _observation(r: Result) -> str:
    out = r.output
    if len(out) <= OBSERVATION_LIMIT:
        return out
    half = OBSERVATION_LIMIT // 2
    return f"{out[:half]}\n[... {len(out) - OBSERVATION_LIMIT} characters cut ...]\n{out[-half:]}"


@dataclass
class GroupResult:
    """One group: its trajectories and what it cost."""

    mode: str
    task_id: str
    trajectories: list[Trajectory]
    latency_s: float
    """Wall time of the group: from the start (setup included) to the last rollout's end."""
    setup_s: float
    """Seconds building set-up workspaces (once per group; summed over rollouts in fresh)."""
    memory: MemoryReport | None
    cpu: dict[str, float]
    cache: dict[str, Any] | None = None
    speculation: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def errors(self) -> list[str]:
        return [f"rollout {t.index}: {t.error}" for t in self.trajectories if t.error]

    def as_dict(self) -> dict[str, Any]:
        """The figures (no trajectories), JSON-ready."""
        lat = sorted(t.latency_s for t in self.trajectories)
        rewards = [t.reward for t in self.trajectories if t.reward is not None]
        sources: dict[str, int] = {}
        for t in self.trajectories:
            for turn in t.turns:
                sources[turn.source] = sources.get(turn.source, 0) + 1
        return {
            "mode": self.mode, "task": self.task_id, "group_size": len(self.trajectories),
            "latency_s": self.latency_s, "setup_s": self.setup_s,
            "rollout_latency_p50_s": lat[len(lat) // 2] if lat else None,
            "rollout_latency_max_s": lat[-1] if lat else None,
            "turns": sum(len(t.turns) for t in self.trajectories),
            "tool_s": sum(t.tool_s for t in self.trajectories),
            "think_s": sum(t.think_s for t in self.trajectories),
            "sources": sources, "errors": self.errors,
            **({"reward_mean": sum(rewards) / len(rewards)} if rewards else {}),
            **({"peak_bytes": self.memory.peak_bytes, "gb_s": self.memory.gb_s,
                "memory_samples": len(self.memory.times),
                "sample_cost_p50_s": self.memory.as_dict()["sample_cost_p50_s"]} if self.memory else {}),
            **self.cpu,
            **({"cache": self.cache} if self.cache is not None else {}),
            **({"speculation": self.speculation} if self.speculation is not None else {}),
            **self.extra,
        }


class _WorthPredictor:
    """The trie's predictions that are worth a fork: not already held by the cache (a hit only
    costs a restore) and recorded as taking at least ``min_exec_s`` (a fork costs more than
    re-running a quick call)."""

    def __init__(self, cache: PrefixCache, task_id: str, top: int, min_exec_s: float) -> None:
        from ..speculate.predict import TriePredictor

        self.inner = TriePredictor(cache, task_id, top=top)
        self.cache = cache
        self.min_exec_s = min_exec_s

    def __call__(self, history: Sequence[ToolCall]) -> list[ToolCall]:
        node = self.inner.node(history)
        live = set(self.cache.live_states())
        out = []
        for c in self.inner(history):
            key = child_key(node, c)
            rec = self.cache.store.get(key)
            if key not in live and rec is not None and (rec.get("exec_time") or 0.0) >= self.min_exec_s:
                out.append(c)
        return out


class PrivateCache:
    """A prefix cache an engine made for itself (``cache=True``), in a temporary directory
    removed with it. It keeps the state after a call that took at least ``snapshot_after()``
    seconds and at least twice what a snapshot has cost so far (a big workspace after a quick
    call is cheaper to re-run than to keep)."""

    def __init__(self, memory_budget: int, snapshot_after: Callable[[], float]) -> None:
        from ..cache.prefix import PrefixCache

        self._dir = tempfile.TemporaryDirectory(prefix="bunshin-rl-cache-")
        self._after = snapshot_after
        try:
            self.cache = PrefixCache(Path(self._dir.name) / "cache.lmdb", memory_budget=memory_budget,
                                     snapshot=self._worth_keeping)
        except BaseException:
            self._dir.cleanup()
            raise

    def _worth_keeping(self, call: ToolCall, r: Result) -> bool:
        st = self.cache.stats
        per = st.snapshot_seconds / st.snapshots if st.snapshots else 0.0
        return r.duration >= max(self._after(), 2 * per)

    def close(self) -> None:
        self.cache.close()
        self._dir.cleanup()


class OwnsCache:
    """An engine that may have made a :class:`PrivateCache` (``_own_cache``): closed by
    :meth:`close`, or on leaving its ``with`` block."""

    _own_cache: PrivateCache | None = None

    def close(self) -> None:
        """Close the private cache (if the engine made one)."""
        if self._own_cache is not None:
            self._own_cache.close()
            self._own_cache = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RolloutEngine(OwnsCache):
    """Run ``group_size`` rollouts of ``task`` with ``policy`` in ``mode`` (one of :data:`MODES`).

    ``concurrency``: rollouts at a time (default: the whole group). ``cache``: in fork/bunshin
    mode, True (a private :class:`~bunshin.PrefixCache` in a temporary directory, closed with
    the engine), a ``PrefixCache`` you own (kept across groups: later groups hit earlier ones'
    states), or False; default on in ``bunshin`` mode only. ``speculate``: run the trie's
    predictions on forks while the policy thinks (needs the cache); default as ``cache``.
    ``snapshot_after``: the private cache keeps the state after calls that took at least this
    many seconds and twice the mean snapshot time so far (a snapshot costs a freeze and a fork;
    quicker calls are cheaper to re-run), and speculation runs only calls that took that long.
    ``predictor(calls so far) -> [ToolCall]``: what speculation runs (default: the trie's most
    visited next calls that the cache does not hold and that took ≥ ``snapshot_after``); e.g. a
    draft model's guesses.
    ``ksm``: criu mode restores with KSM merging (the best stock setup). ``sample_interval``:
    seconds between memory samples (None: no sampler). ``on_turn(rollout_index, turn)`` is
    called after every turn (progress bars). ``indices``: which rollouts of the group to run
    (default ``range(group_size)``; a rerun of part of a group keeps each rollout's index, which
    seeded policies answer by). ``on_rollout(trajectory)`` is called as each rollout ends
    (streaming). ``workspaces``: where rollouts' workspaces come from (an object with
    ``prepare``/``acquire(i)``/``close`` and ``setup_s``, see :mod:`bunshin.rl.workspaces`;
    default: the mode's provider), e.g. forks of a template kept across groups. ``group``:
    which group of a batch this is (the policy sees it in ``History.group``; a policy seeded by
    group acts the same wherever the group runs).
    """

    def __init__(self, policy: Policy, task: Task, group_size: int, mode: str = "bunshin", *,
                 concurrency: int | None = None, cache: bool | PrefixCache | None = None,
                 speculate: bool | None = None, max_inflight: int = 1, cache_budget: int = 4 << 30,
                 snapshot_after: float = 0.05,
                 predictor: Callable[[Sequence[ToolCall]], Sequence[ToolCall]] | None = None,
                 ksm: bool = False, sample_interval: float | None = 0.1,
                 on_turn: Callable[[int, Turn], None] | None = None,
                 indices: Sequence[int] | None = None,
                 on_rollout: Callable[[Trajectory], None] | None = None,
                 workspaces: Any = None, group: int = 0) -> None:
        if not callable(getattr(policy, "act", None)):
            raise RolloutError(f"policy must have an async act(history) method, got {policy!r}")
        if not isinstance(task, Task):
            raise RolloutError(f"task must be a bunshin.rl.Task, got {type(task).__name__}")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise RolloutError(f"group_size must be an int ≥ 1, got {group_size!r}")
        if mode not in MODES:
            raise RolloutError(f"mode must be one of {MODES}, got {mode!r}")
        if concurrency is None:
            concurrency = group_size
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise RolloutError(f"concurrency must be an int ≥ 1, got {concurrency!r}")
        if cache is None:
            cache = mode == "bunshin"
        if speculate is None:
            speculate = bool(cache)
        if (cache or speculate) and mode not in ("fork", "bunshin"):
            raise RolloutError(f"the prefix cache and speculation need forks: mode {mode!r} has neither; "
                               "use mode='fork' or 'bunshin'")
        if speculate and not cache:
            raise RolloutError("speculation predicts from the prefix cache's trie: enable cache too")
        unknown = sorted(set(task.tools) - set(BUILTIN_TOOLS))
        if unknown:
            raise RolloutError(f"task {task.id!r} names unknown tools {unknown}; built in: {sorted(BUILTIN_TOOLS)}")
        self.indices = list(range(group_size)) if indices is None else list(indices)
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < group_size for i in self.indices) \
                or len(set(self.indices)) != len(self.indices):
            raise RolloutError(f"indices must be distinct ints in [0, {group_size}), got {indices!r}")
        if isinstance(group, bool) or not isinstance(group, int) or group < 0:
            raise RolloutError(f"group must be an int ≥ 0, got {group!r}")
        self.on_rollout = on_rollout
        self.workspaces = workspaces
        self.group = group
        self.policy, self.task, self.group_size, self.mode = policy, task, group_size, mode
        self.concurrency = concurrency
        self.ksm = ksm
        self.max_inflight = max_inflight
        self.sample_interval = sample_interval
        self.on_turn = on_turn
        self._own_cache: PrivateCache | None = None
        self.cache: PrefixCache | None
        if cache is True:
            self._own_cache = PrivateCache(cache_budget, lambda: self.snapshot_after)
            self.cache = self._own_cache.cache
        elif cache:
            self.cache = cache
        else:
            self.cache = None
        self.speculate = bool(speculate)
        self.snapshot_after = snapshot_after
        if predictor is not None and not callable(predictor):
            raise RolloutError(f"predictor must be callable(calls) -> list[ToolCall], got {predictor!r}")
        self.predictor = predictor

    # -- running ----------------------------------------------------------------------------
    def run(self) -> GroupResult:
        """Run one group to the end (blocking)."""
        return asyncio.run(self.arun())

    async def arun(self) -> GroupResult:
        """Run one group to the end."""
        from ..speculate.executor import SpeculativeExecutor

        prov = self.workspaces or provider(self.mode, self.task, ksm=self.ksm)
        ex = None
        if self.speculate:
            assert self.cache is not None
            pred = self.predictor or _WorthPredictor(self.cache, self.task.id, self.max_inflight,
                                                     self.snapshot_after)
            ex = SpeculativeExecutor(pred, max_inflight=self.max_inflight)
        cache0 = self.cache.stats if self.cache is not None else None
        pool = ThreadPoolExecutor(max(2, 2 * self.concurrency), thread_name_prefix="bunshin-rollout")
        loop = asyncio.get_running_loop()
        sampler = MemorySampler(self.sample_interval) if self.sample_interval else None
        cpu = CpuMeter().start()
        start = time.monotonic()
        if sampler is not None:
            sampler.start()
        trajs: list[Trajectory] = []
        try:
            await loop.run_in_executor(pool, prov.prepare)
            sem = asyncio.Semaphore(self.concurrency)

            async def one(i: int) -> Trajectory:
                async with sem:
                    t = await self._rollout(i, prov, ex, pool, self.group)
                if self.on_rollout is not None:
                    self.on_rollout(t)
                return t

            trajs = list(await asyncio.gather(*(one(i) for i in self.indices)))
        finally:
            try:
                if ex is not None:
                    await loop.run_in_executor(pool, ex.close)
                await loop.run_in_executor(pool, prov.close)
            finally:
                pool.shutdown(wait=True)
                end = time.monotonic()
                mem = sampler.stop() if sampler is not None else None
        cache_stats = None
        if self.cache is not None and cache0 is not None:
            now = self.cache.stats
            cache_stats = {f.name: getattr(now, f.name) - getattr(cache0, f.name)
                           for f in dataclasses.fields(now)}
            cache_stats["memory_used"] = self.cache.memory_used
        extra = {"dump_s": prov.dump_s} if hasattr(prov, "dump_s") else {}
        return GroupResult(mode=self.mode, task_id=self.task.id, trajectories=trajs, latency_s=end - start,
                           setup_s=prov.setup_s, memory=mem, cpu=cpu.stop(), cache=cache_stats,
                           speculation=dataclasses.asdict(ex.stats) if ex is not None else None, extra=extra)

    async def rollout(self, i: int, prov: Any, ex: Any, pool: ThreadPoolExecutor, group: int = 0) -> Trajectory:
        """Rollout ``i`` (of group ``group`` of a batch) on a workspace from the prepared provider
        ``prov``, speculating through ``ex`` (None: not), its workspace work on ``pool``: the
        unit :class:`~bunshin.rl.batch.BatchEngine` schedules. Never raises but for cancellation."""
        return await self._rollout(i, prov, ex, pool, group)

    async def _rollout(self, i: int, prov, ex, pool: ThreadPoolExecutor, group: int = 0) -> Trajectory:
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        hist = History(self.task, i, group=group)
        final: Final | None = None
        error: str | None = None
        ws = None
        try:
            acquiring = loop.run_in_executor(pool, prov.acquire, i)
            try:
                ws, sh = await asyncio.shield(acquiring)
            except asyncio.CancelledError:  # the workspace is made all the same: close it once it is
                with contextlib.suppress(Exception):
                    await (await acquiring)[0].aclose()
                raise
            if self.cache is not None:
                target: Any = self.cache.rollout(ws, self.task.id)
                target._shell = sh  # continue the setup's shell, as in every other mode
            else:
                target = ToolContext(ws, lambda: sh)
            while len(hist.turns) < self.task.max_steps:
                if ex is not None:
                    await loop.run_in_executor(pool, ex.prefetch, target, hist.calls())
                t = time.monotonic()
                replies = len(hist.completions)
                action = await self.policy.act(hist)
                think = time.monotonic() - t
                completion = hist.completions[-1] if len(hist.completions) > replies else None
                if isinstance(action, Final):
                    final = action
                    break
                call = as_tool_call(action)
                if call.name not in self.task.tools:
                    raise RolloutError(f"the policy called tool {call.name!r}, which task "
                                       f"{self.task.id!r} does not offer ({list(self.task.tools)})")
                t = time.monotonic()
                if ex is None and isinstance(target, ToolContext):  # on the event loop
                    r, source = await arun_tool(BUILTIN_TOOLS, target, call), "exec"
                else:
                    r, source = await loop.run_in_executor(pool, self._call, target, ex, call)
                turn = Turn(call, _observation(r), r.exit_code, think_s=think,
                            tool_s=time.monotonic() - t, source=source, completion=completion)
                hist.turns.append(turn)
                if self.on_turn is not None:
                    self.on_turn(i, turn)
        except Exception as e:  # noqa: BLE001 - one failed rollout must not end the group
            log.warning("rollout %d of %s failed: %s", i, self.task.id, e)
            error = f"{type(e).__name__}: {e}"
        except BaseException:  # cancelled: nothing to score
            await self._release(ws, ex, pool)
            raise
        traj = Trajectory(task_id=self.task.id, index=i, mode=self.mode, turns=hist.turns, final=final,
                          start_s=start, end_s=time.monotonic(), error=error,
                          completions=hist.completions, group=group)
        try:
            if isinstance(self.task.verifier, Verifier):
                traj.verdict = await averify(self.task.verifier, ws, traj, self.task.workdir)
        finally:
            await self._release(ws, ex, pool)
        return traj

    @staticmethod
    async def _release(ws: Any, ex: Any, pool: ThreadPoolExecutor) -> None:
        if ws is None:
            return
        try:
            if ex is not None:
                await asyncio.get_running_loop().run_in_executor(pool, ex.discard, ws)
        finally:
            await ws.aclose()

    @staticmethod
    def _call(target: Any, ex: Any, call: ToolCall) -> tuple[Result, str]:
        if ex is not None:
            return ex.call(target, call), target.last_source
        if isinstance(target, ToolContext):
            return run_tool(BUILTIN_TOOLS, target, call), "exec"
        return target.call(call), target.last_source

