"""Group rollouts on a Ray cluster: throughput, memory per node, placement, and a node killed midway.

A real Ray cluster (``ray.cluster_utils.Cluster``: one head without the ``bunshin`` resource,
worker nodes offering it, every node a raylet of its own) runs the repo workload's groups
(bench/workloads/repo.py; ``--tasks`` tasks with the same setup under distinct ids, so each is
set up on the node that runs it first, ``--groups`` groups each, so later groups find their
task's state somewhere) through :class:`bunshin.cluster.ClusterEngine` in ``bunshin`` mode,
over 1, 2 and 3 nodes, then over 3 nodes again with one node killed midway (the node running
the most rollouts once ``--kill-at`` of them are in: its host actor's process SIGKILLed and its
raylet removed, as when a machine dies). Each run starts with new hosts (the last run's are shut
down) and new task ids, and checks that its hosts left no workspace behind.

Every run states ``nodes``, ``completed``, ``failed`` (rollouts of a group the engine failed,
e.g. a refused fork, with its error), ``lost`` (rollouts neither delivered nor failed),
``duplicated`` (delivered twice), rollouts/min, the peak memory of each node's workspaces, template transfers
and their seconds, and placement hits (from the engine's metrics). Memory per node: a sampler
actor pinned to each node accounts the node's workspaces and templates (the cgroups of the
workspaces whose owner is that node's host actor, from the state directory) with
:class:`bunshin.rl.metrics.MemorySampler`: distinct resident pages, each physical page counted
once — the measure of bench/e2e.py — plus the host actor's own peak RSS (VmHWM).

All local nodes share this machine's CPUs, so measured throughput cannot grow with the node
count here; the JSON says so and projects n nodes from the 1-node run (n × its rollouts/min, the
figure when each node has this machine's CPUs). ``--address`` runs against a real cluster
instead (nodes started with ``ray start ... --resources '{"bunshin": 1}'``; every node's
Bunshin state directory local to it): one run over the nodes it has and no kill run (``ray stop
--force`` on a node mid-run is one; the JSON counts what it cost).

usage: python bench/cluster.py [--quick] [--nodes 1,2,3] [--tasks N] [--groups N] [--group N]
                               [--think S] [--per-node N] [--address HOST:PORT] [--kill | --no-kill]
(last stdout line: JSON; PNG in bench/out/cluster.png)
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, memory_facts, png_path

from bunshin.rl.metrics import machine_cpu_seconds
from bunshin.rl.policies import ReplayPolicy

RESOURCE = "bunshin"
SAMPLE_S = 1.0
"""Seconds between memory samples on each node (one costs 30-60 ms here, most in pagemap reads)."""


# ---- memory per node ------------------------------------------------------------------------

def node_state(owner_pids: set[int]) -> tuple[dict[str, list[int]], set[str]]:
    """``{cgroup: host pids}`` of the workspaces and templates owned by ``owner_pids`` (read from
    the state directory's meta files), and the names of the frozen ones."""
    from bunshin.runtime import cgroup, statedir

    be = cgroup.backend()
    groups: dict[str, list[int]] = {}
    frozen: set[str] = set()
    for d in statedir.all_dirs():
        meta = d.read_meta()
        if meta is None or meta.owner_pid not in owner_pids or not meta.cgroup:
            continue
        try:
            cg = be.open(meta.cgroup)
            pids = cg.pids()
            if pids and cg.frozen():
                frozen.add(meta.cgroup)
        except Exception:  # noqa: BLE001 - closed between the listing and the read: holds nothing
            continue
        if pids:
            groups[meta.cgroup] = pids
    return groups, frozen


class NodeMemory:
    """Run as a Ray actor pinned to one node: samples the memory of that node's workspaces."""

    def __init__(self, owner_pids: list[int], interval: float) -> None:
        from bunshin.rl.metrics import MemorySampler

        self.owners = set(owner_pids)
        self.pid = os.getpid()
        state: dict[str, Any] = {}

        def source() -> dict[str, list[int]]:
            state["groups"], state["frozen"] = node_state(self.owners)
            return state["groups"]

        self.sampler = MemorySampler(interval, source, frozen=lambda: state.get("frozen", set()))
        self.host_hwm = 0
        self.sampler.start()

    def _host_hwm(self) -> int:
        for pid in self.owners:
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            self.host_hwm = max(self.host_hwm, int(line.split()[1]) << 10)
            except OSError:
                pass
        return self.host_hwm

    def peek(self) -> dict:
        """The figures so far (a killed node's are the last ones read)."""
        r = self.sampler.report
        return {"peak_bytes": r.peak_bytes, "samples": len(r.times), "host_rss_peak_bytes": self._host_hwm(),
                "pid": self.pid}

    def stop(self) -> dict:
        self._host_hwm()
        r = self.sampler.stop()
        return {**r.as_dict(), "host_rss_peak_bytes": self.host_hwm, "pid": self.pid}


class Samplers:
    """One :class:`NodeMemory` per host, polled every few seconds so a node that dies leaves its
    last figures."""

    def __init__(self, hosts: dict[str, Any]) -> None:
        import ray
        from ray import cloudpickle
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if __name__ != "__main__":  # imported (a test): the workers cannot import bench/, ship it
            cloudpickle.register_pickle_by_value(sys.modules[__name__])
        infos = dict(zip(hosts, ray.get([h.info.remote() for h in hosts.values()])))
        actor = ray.remote(NodeMemory)
        self.actors = {
            node: actor.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
            .remote([infos[node]["pid"]], SAMPLE_S)
            for node in hosts}
        self.host_pids = {node: infos[node]["pid"] for node in hosts}
        self.last: dict[str, dict] = {}
        self.poll()

    def poll(self) -> None:
        import ray

        for node, a in self.actors.items():
            try:
                self.last[node] = ray.get(a.peek.remote(), timeout=5)
            except Exception:  # noqa: BLE001 - a dead node keeps its last figures
                pass

    def stop(self) -> dict[str, dict]:
        import ray

        out = {}
        for node, a in self.actors.items():
            try:
                out[node] = ray.get(a.stop.remote(), timeout=30)
            except Exception as e:  # noqa: BLE001 - the node died: what was read before it did
                out[node] = {**self.last.get(node, {}), "died": f"{type(e).__name__}"}
            ray.kill(a)
        return out


# ---- the local cluster ----------------------------------------------------------------------

class LocalCluster:
    """A head (the driver's node, no ``bunshin`` resource: it is never killed) and worker nodes
    offering the resource, all raylets on this machine."""

    def __init__(self, node_cpus: int) -> None:
        from ray.cluster_utils import Cluster

        t = time.monotonic()
        # Ray's memory monitor judges the whole machine and kills workers, the hosts included,
        # when it runs low: on a shared machine, for others' memory (workspaces have cgroup limits)
        os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
        self.node_cpus = node_cpus
        # no dashboard, and the agent on a free port: a head takes 52365 by default, and a second
        # cluster on the machine (another job, a test) would then lose its raylet with its agent
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "include_dashboard": False, "dashboard_agent_listen_port": None})
        self.nodes: dict[str, Any] = {}
        self.start_s = time.monotonic() - t

    def connect(self) -> None:
        import ray

        ray.init(address=self.cluster.address, log_to_driver=False, logging_level=logging.WARNING)

    def grow(self, n: int) -> float:
        """Add worker nodes until there are ``n``; seconds it took."""
        t = time.monotonic()
        while len(self.nodes) < n:
            node = self.cluster.add_node(num_cpus=self.node_cpus, resources={RESOURCE: 1})
            self.nodes[node.node_id] = node
        self.cluster.wait_for_nodes()
        return time.monotonic() - t

    def kill(self, node_id: str, pids: list[int]) -> None:
        """The node dies as a machine does: its processes ``pids`` (host and sampler actors)
        SIGKILLed, then its raylet (a raylet's workers otherwise live on for seconds)."""
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.cluster.remove_node(self.nodes.pop(node_id), allow_graceful=False)

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()


# ---- one run --------------------------------------------------------------------------------

def make_tasks(wl, n: int, tag: str) -> list:
    """``n`` tasks with the workload's setup under distinct ids (new per run: a run never
    finds another run's templates)."""
    return [dataclasses.replace(wl.task, id=f"{wl.task.id}-{tag}-t{k}") for k in range(n)]


def stop_hosts(hosts: dict[str, Any]) -> None:
    """Close every host's workspaces and end the hosts, so the next run starts with none."""
    import ray

    for h in hosts.values():
        try:
            ray.get(h.shutdown.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - a killed node's host is gone already
            pass
        ray.kill(h)


def run(wl, args, nodes: int, *, kill: bool, cluster: LocalCluster | None, tag: str, log) -> dict:
    from bunshin.cluster import ClusterEngine, start_hosts

    tasks = make_tasks(wl, args.tasks, tag)
    expected = {(t.id, g, i) for t in tasks for g in range(args.groups) for i in range(args.group)}
    policy = ReplayPolicy(wl.traces, think_s=args.think, jitter=args.jitter, seed=args.seed)
    hosts = start_hosts(resource=RESOURCE)
    samplers = Samplers(hosts)
    seen: dict[tuple, int] = {}
    errors: list[str] = []
    unexpected: list[dict] = []
    times: list[float] = []
    killed: dict[str, Any] = {}
    cpu0, t0 = machine_cpu_seconds(), time.monotonic()
    last_poll = t0
    eng = ClusterEngine(policy, tasks, args.group, groups=args.groups, mode="bunshin", hosts=hosts,
                        per_node=args.per_node)
    try:
        for traj in eng.stream():
            now = time.monotonic()
            key = (traj.task_id, traj.group, traj.index)
            seen[key] = seen.get(key, 0) + 1
            times.append(now - t0)
            if traj.error:
                errors.append(f"{key}: {traj.error}")
            for k, turn in enumerate(traj.turns):
                want = wl.expect[traj.index][k] if k < len(wl.expect[traj.index]) else None
                if want is not None and turn.exit_code != want:
                    unexpected.append({"rollout": list(key), "node": traj.node[:8], "step": k,
                                       "exit_code": turn.exit_code, "expected": want, "source": turn.source,
                                       "output_tail": turn.observation[-300:]})
            if now - last_poll > 2:
                samplers.poll()
                last_poll = now
            if kill and not killed and len(seen) >= len(expected) * args.kill_at:
                killed = kill_busiest(hosts, samplers, cluster, now - t0, log)
    finally:
        wall = time.monotonic() - t0
        cpu = machine_cpu_seconds() - cpu0
        memory = samplers.stop()
        metrics = dict(eng.metrics)
        if cluster is not None:  # a real cluster's hosts may serve others: they end with this job
            stop_hosts(hosts)
    left = leftovers(set(samplers.host_pids.values())) if cluster is not None else None
    completed = sum(1 for k in seen if k in expected)
    undelivered = expected - set(seen)
    failed = {(e["task"], e["group"]): e["error"] for e in metrics.get("group_errors", [])}
    in_failed = {k for k in undelivered if k[:2] in failed}
    res = {
        "nodes": nodes, "kill": kill, "tasks": len(tasks), "groups_per_task": args.groups, "group": args.group,
        "per_node": args.per_node,
        "expected": len(expected),
        "completed": completed, "lost": len(undelivered - in_failed),
        "failed": len(in_failed),
        "failed_groups": [{"task": t, "group": g, "error": e[:300]} for (t, g), e in failed.items()],
        "duplicated": sum(c - 1 for c in seen.values() if c > 1),
        "unexpected_keys": len(set(seen) - expected), "rollout_errors": errors[:20],
        "calls_unexpected": len(unexpected), "calls_unexpected_first": unexpected[:8],
        "wall_s": wall, "rollouts_per_min": 60 * completed / wall if wall else None,
        "machine_cpu_busy": cpu / (wall * (os.cpu_count() or 1)) if wall else None,
        "completion_times_s": [round(x, 3) for x in times],
        "memory": {n[:8]: m for n, m in memory.items()},
        "peak_memory_per_node_bytes": {n[:8]: m.get("peak_bytes") for n, m in memory.items()},
        "engine_metrics": {k: v for k, v in metrics.items() if k != "placements"},
        **placement_figures(metrics), "left_workspaces": left,
    }
    if killed:
        res["killed"] = killed
    return res


def leftovers(owner_pids: set[int], wait_s: float = 15.0) -> int:
    """Workspaces (and templates) of this run's hosts still there after the hosts ended or died
    (a dead owner's are reclaimed by its watcher within a second or so); 0 is clean."""
    end = time.monotonic() + wait_s
    while True:
        from bunshin.runtime import statedir

        n = sum(1 for d in statedir.all_dirs() if (m := d.read_meta()) is not None and m.owner_pid in owner_pids)
        if n == 0 or time.monotonic() > end:
            return n
        time.sleep(0.2)


def placement_figures(metrics: dict) -> dict:
    """The engine's counts under the bench's names. A placement *hit* is a chunk of a group sent
    to a node that held its task's state (its set-up template, or a cached prefix); the other
    chunks (``placement_by``) went to the least loaded node (``load``: no node had the state)
    or, the holders being full, to a free node that pulled the template (``pulled``) or set the
    task up again (``setup``). Template transfers: the pulls, with their seconds (save, stream,
    load)."""
    hits = metrics.get("hits", {})
    return {"placements": sum(hits.values()), "placement_hits": hits.get("template", 0) + hits.get("prefix", 0),
            "placement_by": hits,
            "template_transfers": metrics.get("transfers"), "template_transfer_s": metrics.get("transfer_s"),
            "hosts_lost": len(metrics.get("hosts_lost", [])), "reruns": metrics.get("reruns"),
            "duplicates_dropped": metrics.get("duplicates")}


def kill_busiest(hosts: dict[str, Any], samplers: Samplers, cluster: LocalCluster | None, at: float, log) -> dict:
    """Kill the node running the most rollouts now."""
    import ray

    running = {}
    for node, h in hosts.items():
        try:
            running[node] = ray.get(h.info.remote(), timeout=5)["running"]
        except Exception:  # noqa: BLE001 - already gone
            continue
    node = max(running, key=lambda n: running[n])
    samplers.poll()
    assert cluster is not None
    cluster.kill(node, [samplers.host_pids[node], samplers.last.get(node, {}).get("pid", 0)])
    log(f"killed node {node[:8]} at {at:.1f} s ({running[node]} rollouts running on it)")
    return {"node": node[:8], "at_s": at, "running_on_it": running[node]}


# ---- main -----------------------------------------------------------------------------------

def main() -> int:
    from workloads import WORKLOADS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 tasks × 2 groups of 3, short think time")
    p.add_argument("--nodes", default="1,2,3", help="node counts to run, comma-separated (local cluster)")
    p.add_argument("--tasks", type=int, default=None, help="tasks per run (default 6; quick 3)")
    p.add_argument("--groups", type=int, default=None, help="groups per task (default 3; quick 2): the later "
                   "ones find the task's state (or pull its template when its holder is full)")
    p.add_argument("--group", type=int, default=None, help="rollouts per group (default 8; quick 3)")
    p.add_argument("--think", type=float, default=None, help="seconds of generation per step (default: the "
                   "workload's)")
    p.add_argument("--jitter", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-node", type=int, default=None, help="rollouts at once per node (default: two groups)")
    p.add_argument("--node-cpus", type=int, default=2, help="logical CPUs each local node declares")
    p.add_argument("--kill-at", type=float, default=0.3, help="kill a node once this fraction of rollouts is in")
    p.add_argument("--kill", action=argparse.BooleanOptionalAction, default=None,
                   help="the node-kill run (default: on for a local cluster, off with --address)")
    p.add_argument("--address", default=None, help="a running cluster (ray start); its nodes are used as they are")
    args = p.parse_args()
    args.tasks = args.tasks or (3 if args.quick else 6)  # quick: one task per node at 3 nodes
    args.groups = args.groups or (2 if args.quick else 3)
    args.group = args.group or (3 if args.quick else 8)
    args.per_node = args.per_node or 2 * args.group
    args.kill = (args.address is None) if args.kill is None else args.kill
    if args.kill and args.address is not None:
        p.error("--kill needs the local cluster (the bench kills one of its own raylets)")
    logging.basicConfig(level=logging.WARNING)
    from rich.console import Console

    console = Console(stderr=True, width=None if Console(stderr=True).is_terminal else 140)
    wl = WORKLOADS["repo"](args.group, seed=args.seed, quick=args.quick)
    args.think = args.think if args.think is not None else wl.params.get("think_s", 0.5)
    args.jitter = args.jitter if args.jitter is not None else wl.params.get("think_jitter", 0.3)
    counts = [int(x) for x in args.nodes.split(",") if x.strip()]
    t0 = time.monotonic()
    runs: list[dict] = []
    cluster = None
    import ray

    try:
        if args.address is None:
            cluster = LocalCluster(args.node_cpus)
            cluster.connect()
            plan = [(n, False) for n in counts] + ([(max(counts), True)] if args.kill else [])
        else:
            ray.init(address=args.address, log_to_driver=False, logging_level=logging.WARNING)
            have = sum(1 for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(RESOURCE, 0) > 0)
            plan = [(have, False)]
        for k, (n, kill) in enumerate(plan):
            grow_s = cluster.grow(n) if cluster is not None else 0.0
            console.print(f"[bold]{n} node(s){', one killed midway' if kill else ''}[/] (nodes up in {grow_s:.1f} s)")
            r = run(wl, args, n, kill=kill, cluster=cluster, tag=f"r{k}", log=console.print)
            r["nodes_up_s"] = grow_s
            runs.append(r)
            console.print(f"  completed {r['completed']}/{r['expected']}, failed {r['failed']}, lost {r['lost']}, "
                          f"duplicated {r['duplicated']}, {r['rollouts_per_min']:.1f}/min, {r['wall_s']:.1f} s")
    finally:
        if cluster is not None:
            cluster.shutdown()
        else:
            ray.shutdown()
    res = summarize(runs, args, wl, cluster, time.monotonic() - t0)
    plot(res)
    emit("cluster", res)
    return 0


def summarize(runs: list[dict], args, wl, cluster: LocalCluster | None, wall: float) -> dict:
    base = next((r for r in runs if r["nodes"] == 1 and not r["kill"]), None)
    per_node = base["rollouts_per_min"] if base else None
    for r in runs:
        r["rollouts_per_min_per_node"] = r["rollouts_per_min"] / r["nodes"] if r["nodes"] else None
        r["projected_rollouts_per_min"] = per_node * r["nodes"] if per_node else None
        r["scaling_vs_projection"] = (r["rollouts_per_min"] / r["projected_rollouts_per_min"]
                                      if r["projected_rollouts_per_min"] else None)
    ok = [r for r in runs if r["kill"] or r["nodes"] >= 3]
    return {
        "quick": args.quick, "workload": "repo", "params": wl.params, "tasks": args.tasks, "groups": args.groups,
        "group": args.group, "per_node": args.per_node,
        "think_s": args.think, "jitter": args.jitter, "seed": args.seed, "mode": "bunshin",
        "cluster": ("local: ray.cluster_utils.Cluster, a head without the resource and one raylet per node, "
                    f"each declaring {args.node_cpus} CPUs and {{'{RESOURCE}': 1}}") if cluster else
                   f"existing: {args.address}",
        "cluster_start_s": cluster.start_s if cluster else None,
        "cpus_shared": (f"every node of this local cluster runs on this one machine and shares its {os.cpu_count()} "
                        "CPUs: measured rollouts/min cannot grow with nodes here. projected_rollouts_per_min = "
                        "nodes × the 1-node run's rollouts/min, what n machines like this one would give "
                        "(placement keeps a group's forks on one node, so nodes share nothing but the trainer)")
                       if cluster else "one machine per node",
        "memory_measure": ("per node: the workspaces and templates owned by the node's host actor (their cgroups, "
                           "from the state directory), distinct resident pages counted once (MemorySampler, "
                           f"every {SAMPLE_S} s); host_rss_peak_bytes: the host actor process's VmHWM"),
        "runs": runs,
        "aims": {"lost=0 and duplicated=0 at 3 nodes and in the kill run":
                 bool(ok) and all(r["lost"] == 0 and r["duplicated"] == 0 for r in ok)},
        "wall_s": wall, "memory_facts": memory_facts(),
    }


def plot(res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = res["runs"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    labels = [f"{r['nodes']}{' kill' if r['kill'] else ''}" for r in runs]
    x = range(len(runs))
    ax = axes[0]
    ax.bar([i - 0.2 for i in x], [r["rollouts_per_min"] or 0 for r in runs], 0.4, label="measured (shared CPUs)")
    ax.bar([i + 0.2 for i in x], [r["projected_rollouts_per_min"] or 0 for r in runs], 0.4,
           label="projected (n × 1 node)")
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("nodes")
    ax.set_title("rollouts/min")
    ax.legend(fontsize=8)
    ax = axes[1]
    for i, r in enumerate(runs):
        peaks = [v / 2**20 for v in r["peak_memory_per_node_bytes"].values() if v]
        ax.scatter([i] * len(peaks), peaks, color="#1f77b4")
    ax.set_xticks(list(x), labels)
    ax.set_title("peak workspace memory per node (MiB, pages once)")
    ax = axes[2]
    for r, lab in zip(runs, labels):
        t = r["completion_times_s"]
        ax.step(t, range(1, len(t) + 1), where="post", label=lab)
        if r.get("killed"):
            ax.axvline(r["killed"]["at_s"], color="red", ls="--", lw=1)
    ax.set_xlabel("seconds")
    ax.set_title("rollouts delivered (red: node killed)")
    ax.legend(fontsize=8)
    fig.suptitle(f"Cluster group rollouts: repo, {res['tasks']} tasks × {res['groups']} groups × {res['group']}"
                 f"{' (--quick)' if res['quick'] else ''}")
    fig.tight_layout()
    fig.savefig(png_path("cluster"), dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
