"""``BatchEngine``: one call runs a whole training batch, many tasks × groups, under one limit
of rollouts at a time, and hands back each trajectory as it finishes.

>>> eng = BatchEngine(policy, [task_a, task_b, task_a], group_size=8, max_concurrency=16)  # doctest: +SKIP
>>> for traj in eng.stream():        # or `async for traj in eng.astream()`    # doctest: +SKIP
...     trainer.add(traj.task_id, traj.group, traj.index, traj.reward)        # doctest: +SKIP
>>> eng.result.groups[0].trajectories                                        # doctest: +SKIP

Each entry of ``tasks`` is one group of ``group_size`` rollouts (``Trajectory.group`` is its
position). Entries with the same task id are groups of one task: its workspace is set up once
(one template in fork/bunshin mode, one CRIU image in criu mode) for all of them, and the
prefix cache (one for the batch) answers one group's calls from another's states. A task's
setup runs when its first rollout gets a slot and is let go when its last one ends, so a big
batch holds only the templates of tasks under way.

A rollout that fails, or whose task's setup fails, keeps the error in its trajectory (and a
failed verdict when the task has a verifier); the batch goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .engine import GroupResult, OwnsCache, PrivateCache, RolloutEngine, _WorthPredictor
from .metrics import CpuMeter, MemoryReport, MemorySampler
from .types import Policy, RolloutError, Task, Trajectory, Verifier
from .verify import averify
from .workspaces import provider

if TYPE_CHECKING:
    from ..cache.prefix import PrefixCache
    from ..cache.toolcall import ToolCall

__all__ = ["BatchEngine", "BatchResult"]

#: how long leaving a stream early waits for the batch to stop (its tool calls end within
#: their timeouts, its workspaces close)
STOP_WAIT_S = 300.0


@dataclass
class BatchResult:
    """A finished batch: one GroupResult per entry of ``tasks`` (in order) and what it cost.

    The groups' ``setup_s`` is their task's (shared by its groups); their ``memory`` and ``cpu``
    are the batch's (one sampler for the batch). ``max_in_flight``: the most rollouts that ran at
    once.
    """

    groups: list[GroupResult]
    latency_s: float
    setup_s: float
    memory: MemoryReport | None
    cpu: dict[str, float]
    max_in_flight: int
    cache: dict[str, Any] | None = None
    speculation: dict[str, Any] | None = None

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]

    @property
    def errors(self) -> list[str]:
        return [f"group {t.group} ({t.task_id}) rollout {t.index}: {t.error}" for t in self.trajectories if t.error]

    def as_dict(self) -> dict[str, Any]:
        """The figures (no trajectories), JSON-ready."""
        rewards = [t.reward for t in self.trajectories if t.reward is not None]
        return {
            "groups": len(self.groups), "rollouts": len(self.trajectories), "latency_s": self.latency_s,
            "setup_s": self.setup_s, "max_in_flight": self.max_in_flight, "errors": self.errors,
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "verifier_errors": sum(1 for t in self.trajectories if t.verdict is not None and t.verdict.error),
            **({"peak_bytes": self.memory.peak_bytes, "gb_s": self.memory.gb_s} if self.memory else {}),
            **self.cpu,
            **({"cache": self.cache} if self.cache is not None else {}),
            **({"speculation": self.speculation} if self.speculation is not None else {}),
        }


class _TaskState:
    """One task of the batch: its rollout engine, its workspace source, prepared on first use
    and released after its last rollout."""

    def __init__(self, engine: RolloutEngine, rollouts: int) -> None:
        self.engine = engine
        self.left = rollouts
        self.lock = asyncio.Lock()
        self.prov: Any = None
        self.preparing: asyncio.Future | None = None
        self.ex: Any = None
        self.failure: str | None = None
        self.setup_s = 0.0

    async def ready(self, pool: ThreadPoolExecutor, speculator: Callable[[RolloutEngine], Any]) -> None:
        async with self.lock:
            if self.prov is not None or self.failure is not None:
                return
            eng = self.engine
            try:
                self.prov = provider(eng.mode, eng.task, ksm=eng.ksm)
                self.preparing = asyncio.get_running_loop().run_in_executor(pool, self.prov.prepare)
                # shielded: a cancelled rollout leaves the setup to finish, for release() to undo
                await asyncio.shield(self.preparing)
            except Exception as e:  # noqa: BLE001 - the task's rollouts record it; the batch goes on
                self.failure = f"{type(e).__name__}: {e}"
                await self.release(pool)
                return
            self.setup_s = self.prov.setup_s
            self.ex = speculator(eng)

    async def release(self, pool: ThreadPoolExecutor) -> None:
        loop = asyncio.get_running_loop()
        if self.preparing is not None:
            await asyncio.gather(self.preparing, return_exceptions=True)
            self.preparing = None
        prov, ex, self.prov, self.ex = self.prov, self.ex, None, None
        try:
            if ex is not None:
                await loop.run_in_executor(pool, ex.close)
        finally:
            if prov is not None:
                await loop.run_in_executor(pool, prov.close)


class BatchEngine(OwnsCache):
    """Run a group of ``group_size`` rollouts for every entry of ``tasks`` with ``policy`` in
    ``mode``, at most ``max_concurrency`` rollouts at a time across the batch (default: all).

    ``run()`` (or ``await arun()``) returns a :class:`BatchResult`; ``stream()`` (a thread runs
    the batch) and ``astream()`` (on the caller's event loop) yield each :class:`Trajectory` as
    it finishes, and leave the BatchResult in ``self.result`` once exhausted. Leaving a stream
    early cancels the rollouts still running and releases their workspaces.

    ``cache``, ``speculate``, ``max_inflight``, ``cache_budget``, ``snapshot_after``,
    ``predictor``, ``ksm`` and ``sample_interval`` are :class:`RolloutEngine`'s; the private
    cache (``cache=True``, the default in bunshin mode) is one for the whole batch.
    """

    def __init__(self, policy: Policy, tasks: Sequence[Task], group_size: int, mode: str = "bunshin", *,
                 max_concurrency: int | None = None, cache: bool | PrefixCache | None = None,
                 speculate: bool | None = None, max_inflight: int = 1, cache_budget: int = 4 << 30,
                 snapshot_after: float = 0.05,
                 predictor: Callable[[Sequence[ToolCall]], Sequence[ToolCall]] | None = None,
                 ksm: bool = False, sample_interval: float | None = 0.1) -> None:
        from ..cache.prefix import PrefixCache

        if isinstance(tasks, (str, bytes, Task)) or not isinstance(tasks, Sequence) or not tasks:
            raise RolloutError(f"tasks must be a non-empty sequence of bunshin.rl.Task, got {tasks!r:.200}")
        by_id: dict[str, Task] = {}
        for n, t in enumerate(tasks):
            if not isinstance(t, Task):
                raise RolloutError(f"tasks[{n}] must be a bunshin.rl.Task, got {type(t).__name__}")
            if by_id.setdefault(t.id, t) != t:
                raise RolloutError(f"tasks[{n}] has id {t.id!r} like an earlier, different task: a task id "
                                   "names one setup (its template and prefix-cache entries); rename one")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise RolloutError(f"group_size must be an int ≥ 1, got {group_size!r}")
        if max_concurrency is None:
            max_concurrency = len(tasks) * group_size
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise RolloutError(f"max_concurrency must be an int ≥ 1, got {max_concurrency!r}")
        self.tasks = list(tasks)
        self.group_size, self.mode, self.max_concurrency = group_size, mode, max_concurrency
        self.max_inflight, self.snapshot_after, self.sample_interval = max_inflight, snapshot_after, sample_interval
        self.predictor = predictor
        if cache is None:
            cache = mode == "bunshin"
        self._own_cache: PrivateCache | None = None
        self.cache: PrefixCache | None = cache if isinstance(cache, PrefixCache) else None
        if cache is True and mode in ("fork", "bunshin"):  # other modes: the engines below refuse it
            self._own_cache = PrivateCache(cache_budget, lambda: self.snapshot_after)
            self.cache = cache = self._own_cache.cache
        try:  # one rollout engine per task checks the arguments and runs its rollouts; they share the cache
            self.engines = {tid: RolloutEngine(policy, t, group_size, mode, cache=cache, speculate=speculate,
                                               max_inflight=max_inflight, snapshot_after=snapshot_after,
                                               predictor=predictor, ksm=ksm, sample_interval=None)
                            for tid, t in by_id.items()}
        except BaseException:
            self.close()
            raise
        self.result: BatchResult | None = None

    def _speculator(self, eng: RolloutEngine) -> Any:
        if not eng.speculate:
            return None
        from ..speculate.executor import SpeculativeExecutor

        assert self.cache is not None
        pred = self.predictor or _WorthPredictor(self.cache, eng.task.id, self.max_inflight, self.snapshot_after)
        return SpeculativeExecutor(pred, max_inflight=self.max_inflight)

    # -- running ----------------------------------------------------------------------------
    def run(self) -> BatchResult:
        """Run the batch to the end (blocking)."""
        return asyncio.run(self.arun())

    async def arun(self) -> BatchResult:
        """Run the batch to the end."""
        async for _ in self.astream():
            pass
        assert self.result is not None
        return self.result

    async def astream(self) -> AsyncIterator[Trajectory]:
        """Each trajectory as it finishes; ``self.result`` once all have."""
        self.result = None
        states = {tid: _TaskState(eng, self.group_size * sum(1 for t in self.tasks if t.id == tid))
                  for tid, eng in self.engines.items()}
        pool = ThreadPoolExecutor(max(2, 2 * self.max_concurrency), thread_name_prefix="bunshin-batch")
        sem = asyncio.Semaphore(self.max_concurrency)
        running = [0, 0]  # now, most
        cache0 = self.cache.stats if self.cache is not None else None
        sampler = MemorySampler(self.sample_interval) if self.sample_interval else None
        cpu = CpuMeter().start()
        start = time.monotonic()
        if sampler is not None:
            sampler.start()

        async def one(g: int, i: int) -> Trajectory:
            st = states[self.tasks[g].id]
            async with sem:
                running[0] += 1
                running[1] = max(running)
                try:
                    await st.ready(pool, self._speculator)
                    if st.failure is None:
                        return await st.engine.rollout(i, st.prov, st.ex, pool, group=g)
                    return await self._failed(st.engine.task, g, i, st.failure)
                finally:
                    running[0] -= 1
                    st.left -= 1
                    if st.left == 0:
                        await st.release(pool)

        jobs = [asyncio.ensure_future(one(g, i)) for g in range(len(self.tasks)) for i in range(self.group_size)]
        done: list[Trajectory] = []
        try:
            for fut in asyncio.as_completed(jobs):
                traj = await fut
                done.append(traj)
                yield traj
        finally:
            for j in jobs:
                j.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            try:
                for st in states.values():
                    await st.release(pool)  # those a cancellation left
            finally:
                pool.shutdown(wait=True)
                end = time.monotonic()
                mem = sampler.stop() if sampler is not None else None
                usage = cpu.stop()
        if len(done) == len(jobs):
            self.result = self._result(done, states, start, end, mem, usage, running[1], cache0)

    async def _failed(self, task: Task, g: int, i: int, failure: str) -> Trajectory:
        now = time.monotonic()
        traj = Trajectory(task_id=task.id, index=i, mode=self.mode, turns=[], final=None, start_s=now, end_s=now,
                          error=f"the task's setup failed: {failure}", group=g)
        if isinstance(task.verifier, Verifier):
            traj.verdict = await averify(task.verifier, None, traj)
        return traj

    def _result(self, done: list[Trajectory], states: dict[str, _TaskState], start: float, end: float,
                mem: MemoryReport | None, usage: dict[str, float], most: int, cache0: Any) -> BatchResult:
        groups = []
        for g, task in enumerate(self.tasks):
            trajs = sorted((t for t in done if t.group == g), key=lambda t: t.index)
            groups.append(GroupResult(mode=self.mode, task_id=task.id, trajectories=trajs,
                                      latency_s=max(t.end_s for t in trajs) - min(t.start_s for t in trajs),
                                      setup_s=states[task.id].setup_s, memory=mem, cpu=usage))
        cache_stats = None
        if self.cache is not None and cache0 is not None:
            now = self.cache.stats
            cache_stats = {f.name: getattr(now, f.name) - getattr(cache0, f.name) for f in dataclasses.fields(now)}
        return BatchResult(groups=groups, latency_s=end - start, setup_s=sum(s.setup_s for s in states.values()),
                           memory=mem, cpu=usage, max_in_flight=most, cache=cache_stats)

    def stream(self) -> Iterator[Trajectory]:
        """Each trajectory as it finishes, from a thread that runs the batch on an event loop of
        its own (rollouts go on while the caller works on one); ``self.result`` once all have.
        Leaving the loop early stops the rollouts still running."""
        from ..runtime.aio import iterate_in_thread

        # its cleanup (closing the rollouts' workspaces, waiting for their calls) must end
        # before close() closes the private cache it may still use
        yield from iterate_in_thread(self.astream, "bunshin-batch-loop", STOP_WAIT_S)

