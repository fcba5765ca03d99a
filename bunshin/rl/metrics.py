"""The memory and CPU a rollout run costs, sampled while it runs.

:class:`MemorySampler` is a background thread that, every ``interval`` seconds, accounts the
true footprint of everything Bunshin holds — every workspace, template, speculative branch and
restored clone is in a cgroup under :func:`bunshin.config.cgroup_prefix` — with
:func:`bunshin.memory.pids_usage`, which counts a physical page once however many processes map
it. From the samples it reports the peak and the integral over time (GB·s, trapezoids over the
real sample times). Sampling takes time on big families; the thread never uses more than half a
core: it sleeps at least as long as its last sample took, and reports that cost.

Frozen processes (templates, cached states) cannot change their page tables, so their PFNs are
read once and reused for ``revalidate_s`` seconds (the kernel may still migrate a page now and
then; re-reading bounds that error in time). The cache is keyed by pid and start time.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Self

import numpy as np

from ..runtime.statedir import proc_start_time

__all__ = ["CpuMeter", "MemoryReport", "MemorySampler", "cgroup_frozen", "cgroup_pids", "cgroup_state",
           "machine_cpu_seconds"]

PidSource = Callable[[], Mapping[str, Sequence[int]]]
FrozenSource = Callable[[], set[str]]


def cgroup_state() -> tuple[dict[str, list[int]], set[str]]:
    """One pass over the groups under Bunshin's cgroup prefix: ``{name: host pids}`` of those
    with processes, and the names of the frozen ones."""
    from ..runtime import cgroup

    be = cgroup.backend()
    out: dict[str, list[int]] = {}
    frozen: set[str] = set()
    seen: set[int] = set()
    for name in be.list():
        try:
            cg = be.open(name)
            pids = cg.pids()
            if pids and cg.frozen():
                frozen.add(name)
        except Exception:  # noqa: BLE001 - removed between list() and open(): it holds nothing
            continue
        # a process moved between groups while we read them (a fork being adopted) counts once
        pids = [p for p in pids if p not in seen]
        seen.update(pids)
        if pids:
            out[name] = pids
    return out, frozen


def cgroup_pids() -> dict[str, list[int]]:
    """``{cgroup name: host pids}`` for every group under Bunshin's cgroup prefix."""
    return cgroup_state()[0]


def cgroup_frozen() -> set[str]:
    """Names of the groups under Bunshin's prefix whose processes are all frozen."""
    return cgroup_state()[1]


@dataclass
class MemoryReport:
    """What a sampler saw: ``times`` (seconds since start) and ``bytes`` per sample."""

    times: list[float] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)
    sample_cost_s: list[float] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return max(self.bytes, default=0)

    @property
    def gb_s(self) -> float:
        """Integral of the footprint over the run, in GB·s (10⁹ bytes × seconds)."""
        area = 0.0
        for i in range(1, len(self.times)):
            area += (self.times[i] - self.times[i - 1]) * (self.bytes[i] + self.bytes[i - 1]) / 2
        return area / 1e9

    def as_dict(self) -> dict:
        cost = sorted(self.sample_cost_s)
        return {"peak_bytes": self.peak_bytes, "gb_s": self.gb_s, "samples": len(self.times),
                "sample_cost_p50_s": cost[len(cost) // 2] if cost else None}


class MemorySampler:
    """Sample ``source()`` (default: :func:`cgroup_pids`) every ``interval`` seconds.

    >>> with MemorySampler() as s:        # doctest: +SKIP
    ...     run_rollouts()
    >>> s.report.peak_bytes, s.report.gb_s  # doctest: +SKIP
    """

    def __init__(self, interval: float = 0.1, source: PidSource | None = None, *,
                 frozen: FrozenSource | None = None, revalidate_s: float = 5.0) -> None:
        from .types import RolloutError

        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval <= 0:
            raise RolloutError(f"interval must be seconds > 0, got {interval!r}")
        self.interval = float(interval)
        self._read: Callable[[], tuple[Mapping[str, Sequence[int]], set[str]]]
        if source is None and frozen is None:
            self._read = cgroup_state  # one pass for both
        else:
            src = source or cgroup_pids
            frz = frozen or (cgroup_frozen if source is None else set)
            self._read = lambda: (src(), frz())
        self.revalidate_s = revalidate_s
        self._cache: dict[int, tuple[int, np.ndarray, float]] = {}  # pid -> (start, pfns, read at)
        self._pool: ThreadPoolExecutor | None = None
        self.report = MemoryReport()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self.error: BaseException | None = None

    def _pfns(self, pid: int, frozen: bool, now: float) -> np.ndarray | None:
        from ..memory.pagemap import read_pfns

        if not frozen:
            # thawed since it was cached (a held template a fork woke): what it ran may have
            # moved its pages, so the next frozen sample reads them again
            self._cache.pop(pid, None)
            return read_pfns(pid)
        start = proc_start_time(pid)
        hit = self._cache.get(pid)
        if hit is not None and hit[0] == start and now - hit[2] < self.revalidate_s:
            return hit[1]
        pfns = read_pfns(pid)
        if pfns is not None and start is not None:
            self._cache[pid] = (start, pfns, now)
        return pfns

    def footprint(self) -> int:
        """Distinct resident pages of everything the source lists, in bytes (not recorded)."""
        from .._core import _pagemap
        from ..memory.pagemap import PAGE_SIZE

        now = time.monotonic()
        groups, frozen = self._read()
        jobs = [(pid, name in frozen) for name, pids in groups.items() for pid in pids]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(min(2, os.cpu_count() or 1), thread_name_prefix="bunshin-sampler")
        parts = [a for a in self._pool.map(lambda j: self._pfns(j[0], j[1], now), jobs) if a is not None]
        live = {pid for pid, _ in jobs}
        for pid in [p for p in self._cache if p not in live]:
            del self._cache[pid]
        if not parts:
            return 0
        top = max((int(p.max()) for p in parts if p.size), default=0)
        _, _, total, _ = _pagemap.count_family(parts, np.zeros(len(parts), dtype=np.int_), 1, top)
        return int(total) * PAGE_SIZE

    def sample(self) -> int:
        """One sample now (also recorded); the footprint in bytes."""
        t = time.monotonic()
        total = self.footprint()
        done = time.monotonic()
        self.report.times.append(t - self._t0)
        self.report.bytes.append(total)
        self.report.sample_cost_s.append(done - t)
        return total

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                t = time.monotonic()
                self.sample()
                cost = time.monotonic() - t
                self._stop.wait(max(self.interval - cost, cost))
        except BaseException as e:  # noqa: BLE001 - surfaced by stop()
            self.error = e

    def start(self) -> Self:
        if self._thread is not None:
            from .types import RolloutError

            raise RolloutError("this sampler was already started; make a new one per run")
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="bunshin-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> MemoryReport:
        """Stop, take a last sample, and return the report (re-raises a sampling error)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error
        self.sample()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        return self.report

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def machine_cpu_seconds() -> float:
    """CPU seconds every core of this machine has spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    vals = [int(x) for x in fields]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    return (sum(vals[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU used between ``start()`` and ``stop()``: this process (trainer threads: fork engine,
    policy, sampler), its reaped children, and the whole machine."""

    def start(self) -> CpuMeter:
        self._self = resource.getrusage(resource.RUSAGE_SELF)
        self._kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        self._machine = machine_cpu_seconds()
        return self

    def stop(self) -> dict[str, float]:
        s = resource.getrusage(resource.RUSAGE_SELF)
        k = resource.getrusage(resource.RUSAGE_CHILDREN)

        def d(a: resource.struct_rusage, b: resource.struct_rusage) -> float:
            return (a.ru_utime - b.ru_utime) + (a.ru_stime - b.ru_stime)

        return {"trainer_cpu_s": d(s, self._self), "children_cpu_s": d(k, self._kids),
                "machine_cpu_s": machine_cpu_seconds() - self._machine}
