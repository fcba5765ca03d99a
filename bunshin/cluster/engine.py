"""``ClusterEngine``: group rollouts of many tasks over the workspace hosts of a Ray cluster.

A group of ``group_size`` rollouts of one task runs on the host that holds the task's set-up
template (forks stay on their node, so memory sharing holds there), else on the host with the
longest cached prefix of the task, else on the least loaded host (fewest rollouts running, most
free memory). Each host runs at most ``per_node`` rollouts at a time: a group is sent in
*chunks* of rollout indices, as slots free up. When the template's holder is full and another
host has slots, a chunk waits for the holder unless setting the task up again elsewhere (the
holder's setup seconds) or pulling the template there (its saved image and the rootfs layers
that host lacks, streamed from the holder's host and loaded; the mean pull so far) is cheaper
than the expected wait (the task's mean rollout seconds so far).

A host lost mid-chunk (``ActorDiedError``, ``ActorUnavailableError``, ``NodeDiedError``)
sends the chunk's rollouts that had not come back to another host, with the same indices (a
policy seeded by index acts the same); trajectories are kept once per (task, group, index). A
task whose setup fails fails its group with :class:`TaskSetupError`; the other groups go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..rl.engine import MODES
from ..rl.types import Policy, RolloutError, Task
from .errors import ClusterError, TaskSetupError
from .types import ClusterGroup, ClusterResult, GroupTrajectory

log = logging.getLogger("bunshin.cluster")

__all__ = ["PULL_PRIOR_S", "PULL_WAIT_S", "STOP_WAIT_S", "ClusterEngine"]

STOP_WAIT_S = 10.0
"""Seconds ``stream()`` waits, when left early, for the hosts to be told to stop."""
PULL_WAIT_S = 600.0
"""Seconds a template pull may take before the destination is told to stop it and sets the
task up itself."""
PULL_PRIOR_S = 1.5
"""What a template pull is assumed to cost before one is measured: a small workspace's save
(~0.7 s), stream and load (~0.4-0.8 s) measured here."""


@dataclass
class _Group:
    task: Task
    policy: Policy
    number: int
    out: ClusterGroup
    todo: list[int]  # indices neither returned nor running
    waited: bool = False

    @property
    def key(self) -> tuple[str, int]:
        return (self.task.id, self.number)


@dataclass
class _Node:
    host: Any
    running: int = 0
    free_memory: int = 0
    tasks: dict[str, float] = field(default_factory=dict)  # task id -> setup seconds (-1: being set up)
    rollout_s: dict[str, float] = field(default_factory=dict)  # task id -> mean rollout seconds there
    depth: dict[str, int] = field(default_factory=dict)


def _lost(e: BaseException) -> bool:
    import ray

    # Ray's memory monitor killing a host (OutOfMemoryError) loses it as surely as a crash
    return isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError,
                          ray.exceptions.ObjectLostError, ray.exceptions.OutOfMemoryError))


def _cause(e: BaseException) -> BaseException:
    import ray

    if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None:
        return e.cause
    return e


class ClusterEngine:
    """Run ``groups`` groups of ``group_size`` rollouts of every task in ``tasks`` on the
    cluster's workspace hosts.

    ``policy``: one policy for every task, or ``{task id: policy}`` (pickled to the hosts).
    ``mode``: as :class:`~bunshin.rl.RolloutEngine` (fork/bunshin fork the host's template of the
    task). ``hosts``: ``{node id: host actor}`` (default: :func:`~bunshin.cluster.start_hosts`).
    ``per_node``: rollouts at a time per host. ``engine``: more ``RolloutEngine`` options,
    passed to the hosts. :attr:`metrics` says where each chunk went and why.
    """

    def __init__(self, policy: Policy | Mapping[str, Policy], tasks: Sequence[Task], group_size: int, *,
                 groups: int = 1, mode: str = "bunshin", hosts: Mapping[str, Any] | None = None,
                 per_node: int = 16, travel: bool = True, engine: Mapping[str, Any] | None = None) -> None:
        tasks = list(tasks)
        if not tasks or not all(isinstance(t, Task) for t in tasks):
            raise RolloutError(f"tasks must be a non-empty list of bunshin.rl.Task, got {tasks!r}")
        if len({t.id for t in tasks}) != len(tasks):
            raise RolloutError("task ids must be distinct: trajectories are keyed by (task id, group, index)")
        for name, v in (("group_size", group_size), ("groups", groups), ("per_node", per_node)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise RolloutError(f"{name} must be an int ≥ 1, got {v!r}")
        if mode not in MODES:
            raise RolloutError(f"mode must be one of {MODES}, got {mode!r}")
        policies = dict(policy) if isinstance(policy, Mapping) else {t.id: policy for t in tasks}
        missing = [t.id for t in tasks if t.id not in policies]
        if missing:
            raise RolloutError(f"no policy for tasks {missing}")
        self.tasks, self.policies = tasks, policies
        self.group_size, self.groups, self.mode, self.per_node = group_size, groups, mode, per_node
        self.engine = dict(engine or {})
        self.travel = travel
        self._pulls = (0.0, 0)
        self._hosts = dict(hosts) if hosts is not None else None
        self.metrics: dict[str, Any] = {}

    # -- public -------------------------------------------------------------------------
    def run(self) -> ClusterResult:
        """Run every group to the end (blocking)."""
        return asyncio.run(self.arun())

    async def arun(self) -> ClusterResult:
        """Run every group to the end."""
        groups = self._new_groups()
        async for _t in self._drive(groups):
            pass
        return ClusterResult({g.key: g.out for g in groups}, self.metrics)

    async def astream(self) -> AsyncIterator[GroupTrajectory]:
        """Each trajectory as its rollout ends, over every group (asyncio)."""
        async for t in self._drive(self._new_groups()):
            yield t

    def stream(self) -> Iterator[GroupTrajectory]:
        """Each trajectory as its rollout ends, over every group (a thread runs the loop).
        Leaving the loop early stops the rollouts still running."""
        from ..runtime.aio import iterate_in_thread

        yield from iterate_in_thread(self.astream, "bunshin-cluster-stream", STOP_WAIT_S)

    # -- scheduling ---------------------------------------------------------------------
    def _new_groups(self) -> list[_Group]:
        return [_Group(t, self.policies[t.id], g, ClusterGroup(t.id, g, self.group_size),
                       list(range(self.group_size)))
                for g in range(self.groups) for t in self.tasks]

    def _place(self, g: _Group, nodes: dict[str, _Node]) -> tuple[str, str] | None:
        """The node for ``g``'s next chunk and why, or None to wait for a slot."""
        free = {n: s for n, s in nodes.items() if s.running < self.per_node}
        holders = [n for n, s in nodes.items() if g.task.id in s.tasks] if self.mode in ("fork", "bunshin") else []

        def load(n: str) -> tuple[int, int]:
            return (nodes[n].running, -nodes[n].free_memory)

        if holders:
            ready = [n for n in holders if n in free]
            if ready:
                return min(ready, key=load), "template"
            if not free:
                return None
            # a template can be pulled only from a holder that has finished setting it up
            set_up = [n for n in holders if nodes[n].tasks[g.task.id] >= 0]
            setup, pull = self._setup_cost(g, nodes, holders), self._pull_cost() if set_up else float("inf")
            if min(setup, pull) < self._wait_cost(g, nodes, holders):
                return min(free, key=load), "pulled" if pull < setup else "setup"
            if not g.waited:
                g.waited = True
                self.metrics["decisions"]["waited"] += 1
            return None
        if not free:
            return None
        deep = [n for n in free if nodes[n].depth.get(g.task.id, 0) > 0]
        if deep:
            return max(deep, key=lambda n: (nodes[n].depth[g.task.id], [-x for x in load(n)])), "prefix"
        return min(free, key=load), "load"

    def _setup_cost(self, g: _Group, nodes: dict[str, _Node], holders: list[str]) -> float:
        """Seconds to set ``g``'s task up again on another node: what it took the holder."""
        known = [nodes[n].tasks[g.task.id] for n in holders if nodes[n].tasks[g.task.id] >= 0]
        return max(known) if known else float("inf")

    def _pull_cost(self) -> float:
        """Seconds to bring a template over from its holder (save, stream, load): the mean of
        this engine's pulls so far, ``PULL_PRIOR_S`` before the first; inf without travel."""
        if not self.travel:
            return float("inf")
        return self._pulls[0] / self._pulls[1] if self._pulls[1] else PULL_PRIOR_S

    def _wait_cost(self, g: _Group, nodes: dict[str, _Node], holders: list[str]) -> float:
        """Expected seconds until a holder frees a slot: a rollout of the task (the mean seen
        by this run, else by the holders; unknown: 0, i.e. wait)."""
        lat = self._latency.get(g.task.id)
        if lat:
            return lat[0] / lat[1]
        known = [nodes[n].rollout_s[g.task.id] for n in holders if g.task.id in nodes[n].rollout_s]
        return min(known) if known else 0.0

    async def _nodes(self) -> dict[str, _Node]:
        from .host import start_hosts

        hosts = self._hosts if self._hosts is not None else start_hosts()
        nodes: dict[str, _Node] = {}
        infos = await asyncio.gather(*(h.info.remote() for h in hosts.values()), return_exceptions=True)
        for (nid, h), info in zip(hosts.items(), infos, strict=True):
            if isinstance(info, BaseException):
                log.warning("workspace host of node %s does not answer (%s); leaving it out", nid, info)
                self.metrics["hosts_lost"].append(nid)
                continue
            nodes[nid] = _Node(h, free_memory=info["free_memory"],
                               tasks={t: v["setup_s"] for t, v in info["tasks"].items()},
                               rollout_s={t: v["rollout_s"] for t, v in info["tasks"].items()
                                          if v["rollout_s"] is not None},
                               depth=dict(info["prefix_depth"]))
        return nodes

    async def _drive(self, groups: list[_Group]) -> AsyncIterator[GroupTrajectory]:
        self.metrics = {"placements": [], "hits": {"template": 0, "prefix": 0, "load": 0, "pulled": 0, "setup": 0},
                        "decisions": {"waited": 0, "pulled": 0, "setup": 0}, "pulls": [], "transfers": 0,
                        "transfer_s": 0.0, "transfer_bytes": 0, "pull_failures": 0, "hosts_lost": [], "reruns": 0,
                        "duplicates": 0, "completed": 0, "failed_groups": 0, "group_errors": [], "per_node": {}}
        self._latency: dict[str, tuple[float, int]] = {}
        nodes = await self._nodes()
        seen: set[tuple[str, int, int]] = set()
        out: asyncio.Queue[GroupTrajectory] = asyncio.Queue()
        wake = asyncio.Event()
        chunks: set[asyncio.Task[None]] = set()

        async def chunk(nid: str, g: _Group, idx: list[int], pull_from: str | None) -> None:
            node = nodes[nid]
            got: set[int] = set()
            gen = None
            try:
                if pull_from is not None and pull_from in nodes:
                    await self._pull(g, nodes, pull_from, nid)
                gen = node.host.run_group.remote(g.task, g.policy, self.group_size, indices=idx, mode=self.mode,
                                                 group=g.number, engine=self.engine)
                async for ref in gen:
                    t: GroupTrajectory = await ref
                    got.add(t.index)
                    node.running -= 1
                    if t.key in seen:
                        self.metrics["duplicates"] += 1
                        continue
                    seen.add(t.key)
                    s, n = self._latency.get(t.task_id, (0.0, 0))
                    self._latency[t.task_id] = (s + t.latency_s, n + 1)
                    g.out.trajectories.append(t)
                    self.metrics["completed"] += 1
                    self.metrics["per_node"][nid] = self.metrics["per_node"].get(nid, 0) + 1
                    out.put_nowait(t)
                    wake.set()
                if self.mode in ("fork", "bunshin") and node.tasks.get(g.task.id, 0) < 0:
                    node.tasks[g.task.id] = await self._setup_s(node, g.task.id)
            except asyncio.CancelledError:
                if gen is not None:  # the caller stopped listening: the host stops the rollouts
                    import ray

                    with contextlib.suppress(Exception):
                        ray.cancel(gen)
                raise
            except Exception as e:  # noqa: BLE001 - sorted below: host lost, setup failed, other
                cause = _cause(e)
                rest = [i for i in idx if i not in got]
                if _lost(e):
                    log.warning("host of node %s lost (%s); %d rollouts of %s group %d go elsewhere",
                                nid, type(e).__name__, len(rest), g.task.id, g.number)
                    if nid in nodes:
                        del nodes[nid]
                        self.metrics["hosts_lost"].append(nid)
                    g.todo.extend(i for i in rest if (g.task.id, g.number, i) not in seen)
                    self.metrics["reruns"] += len(rest)
                else:
                    if not isinstance(cause, TaskSetupError):
                        log.warning("group %d of %s failed on node %s: %r", g.number, g.task.id, nid, cause)
                    node.tasks.pop(g.task.id, None)
                    if g.out.error is None:
                        g.out.error = f"{type(cause).__name__}: {cause}"
                        self.metrics["failed_groups"] += 1
                        self.metrics["group_errors"].append({"task": g.task.id, "group": g.number, "node": nid,
                                                             "error": g.out.error})
                    g.todo.clear()
            finally:
                node.running -= len([i for i in idx if i not in got])
                chunks.discard(asyncio.current_task())
                wake.set()

        def dispatch() -> None:
            for g in groups:
                while g.todo and g.out.error is None:
                    where = self._place(g, nodes)
                    if where is None:
                        break
                    nid, why = where
                    node = nodes[nid]
                    src = None
                    if why == "pulled":
                        src = max((n for n in nodes if nodes[n].tasks.get(g.task.id, -1) >= 0),
                                  key=lambda n: -nodes[n].running)
                    take = min(self.per_node - node.running, len(g.todo))
                    idx, g.todo = sorted(g.todo)[:take], sorted(g.todo)[take:]
                    node.running += len(idx)
                    if self.mode in ("fork", "bunshin"):
                        node.tasks.setdefault(g.task.id, -1.0)
                    self.metrics["hits"][why] += 1
                    if why in ("pulled", "setup"):
                        self.metrics["decisions"][why] += 1
                    self.metrics["placements"].append({"task": g.task.id, "group": g.number, "node": nid,
                                                       "why": why, "indices": idx})
                    chunks.add(asyncio.ensure_future(chunk(nid, g, idx, src)))

        t0 = time.monotonic()
        try:
            while True:
                dispatch()
                while not out.empty():
                    yield out.get_nowait()
                if not chunks and all(not g.todo or g.out.error is not None for g in groups):
                    break
                if not chunks and not nodes:
                    raise ClusterError("every workspace host was lost; "
                                       f"{sum(len(g.todo) for g in groups)} rollouts were not run")
                wake.clear()
                if out.empty():
                    await wake.wait()
        finally:
            for c in list(chunks):
                c.cancel()
            if chunks:
                await asyncio.gather(*chunks, return_exceptions=True)
            for g in groups:
                g.out.trajectories.sort(key=lambda t: t.index)
            self.metrics["seconds"] = time.monotonic() - t0
            self.metrics["lost"] = sum(g.out.group_size - len(g.out.trajectories) for g in groups
                                       if g.out.error is None)

    async def _pull(self, g: _Group, nodes: dict[str, _Node], src: str, dst: str) -> None:
        """Bring ``g``'s task template from node ``src`` to ``dst`` (its image, then the rootfs
        layers ``dst`` lacks, see :meth:`WorkspaceHost.import_task`); if that fails, ``dst``
        sets the task up itself (run_group does), and the failure is counted."""
        import ray

        ref = nodes[dst].host.import_task.remote(g.task, nodes[src].host)
        try:
            moved = await asyncio.wait_for(ref, PULL_WAIT_S)
        except Exception as e:  # noqa: BLE001 - a failed pull costs a setup, not the group
            if isinstance(e, asyncio.TimeoutError):  # the import, not only this wait, must end
                with contextlib.suppress(Exception):
                    ray.cancel(ref)
            if _lost(e) and not isinstance(e, ray.exceptions.RayTaskError):
                raise  # the destination is gone: the chunk goes elsewhere
            log.warning("pulling %s's template from %s to %s failed (%s); setting it up there",
                        g.task.id, src, dst, _cause(e))
            self.metrics["pull_failures"] += 1
            return
        secs = moved["seconds"]
        self._pulls = (self._pulls[0] + secs, self._pulls[1] + 1)
        self.metrics["pulls"].append({"task": g.task.id, "group": g.number, "from": src, "to": dst, **moved})
        self.metrics["transfers"] += 1
        self.metrics["transfer_s"] += secs
        self.metrics["transfer_bytes"] += moved["image_bytes"] + moved["layer_bytes"]
        if dst in nodes:  # either node may have left while the template travelled
            nodes[dst].tasks[g.task.id] = nodes[src].tasks.get(g.task.id, -1.0) if src in nodes else -1.0

    @staticmethod
    async def _setup_s(node: _Node, task_id: str) -> float:
        info = await node.host.info.remote()
        return float(info["tasks"].get(task_id, {}).get("setup_s", -1.0))
