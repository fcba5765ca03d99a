"""Memory of n forks of a workspace vs n independent workspaces running the same workload.

The workload is the medium one of fork_latency.py: init + a bash session + a Python holding
256 MiB of touched memory. Two modes, measured in the same run:
  * forks: one workspace, snapshotted once (tpl = ws.snapshot()), then tpl.fork() until n
    children exist. Counted: the n children + the source workspace (which continues as a fork
    of the template) + the frozen template's processes, which hold the original pages. The
    template is not a Workspace: its pids come from its cgroup (Template._core.body.cgroup).
    So "n forks" means n + 1 live workspaces and one frozen copy.
  * independent: n workspaces created one by one, each starting the same workload.
Two totals per point:
  * distinct physical pages (bunshin.memory.pids_usage over every process of the family; a page
    mapped by several processes, e.g. CoW-shared or the same file page, counts once);
  * Σ cgroup memory (memory_current of every workspace's cgroup, and the template's for forks):
    what the kernel charges; CoW pages stay charged to the cgroup that first touched them.
The aim: distinct-page total of the fork family at the largest n ≤ 1.15 × the same total of
the one workspace before it was forked.

usage: python bench/fork_memory.py [--quick]   (last stdout line: JSON; PNG in bench/out/)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, memory_facts, png_path  # noqa: E402
from _workloads import build_workspace  # noqa: E402

from bunshin.memory import family_usage, pids_usage  # noqa: E402

MIB = 256
_M = 1 << 20


def _cg_bytes(cg) -> int:
    return cg.stats().memory_current or 0


def measure_forks(ns: list[int]) -> tuple[dict, list[dict]]:
    ld = build_workspace(MIB)
    kids: list = []
    points = []
    try:
        u = family_usage([ld.ws])
        one = {"distinct_bytes": u.total_bytes, "pss_bytes": u.pss_bytes,
               "cgroup_bytes": _cg_bytes(ld.ws.cgroup), "processes": len(ld.ws.host_pids())}
        tpl = ld.ws.snapshot()
        try:
            tcg = tpl._core.body.cgroup  # the frozen processes' cgroup: not public API
            for n in ns:
                t = time.perf_counter()
                kids += tpl.fork(n - len(kids))
                fork_s = time.perf_counter() - t
                groups = {"template": tcg.pids(), "source": ld.ws.host_pids(),
                          **{k.id: k.host_pids() for k in kids}}
                u = pids_usage(groups)
                cg = _cg_bytes(tcg) + _cg_bytes(ld.ws.cgroup) + sum(_cg_bytes(k.cgroup) for k in kids)
                kid_private = [u.per_workspace[k.id].private_bytes for k in kids]
                points.append({
                    "n": n, "live_workspaces": n + 1, "distinct_bytes": u.total_bytes,
                    "shared_bytes": u.shared_bytes, "pss_bytes": u.pss_bytes, "cgroup_bytes": cg,
                    "template_cgroup_bytes": _cg_bytes(tcg),
                    "template_rss_bytes": u.per_workspace["template"].rss_bytes,
                    "child_private_bytes_max": max(kid_private),
                    "processes": sum(len(g) for g in groups.values()),
                    "fork_s_for_this_step": fork_s})
        finally:
            for k in kids:
                k.close()
            tpl.close()
    finally:
        ld.close()
    return one, points


def measure_independent(ns: list[int]) -> list[dict]:
    wss: list = []
    points = []
    try:
        for n in ns:
            while len(wss) < n:
                wss.append(build_workspace(MIB))
            u = family_usage([ld.ws for ld in wss])
            points.append({"n": n, "live_workspaces": n, "distinct_bytes": u.total_bytes,
                           "shared_bytes": u.shared_bytes, "pss_bytes": u.pss_bytes,
                           "cgroup_bytes": sum(_cg_bytes(ld.ws.cgroup) for ld in wss),
                           "processes": sum(len(ld.ws.host_pids()) for ld in wss)})
    finally:
        for ld in wss:
            ld.close()
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="n up to 8 (under 2 minutes)")
    args = ap.parse_args()
    ns = [1, 2, 4, 8] if args.quick else [1, 2, 4, 8, 16]
    one, forks = measure_forks(ns)
    indep = measure_independent(ns)
    big_f, big_i = forks[-1], indep[-1]
    nmax = ns[-1]
    res = {
        "quick": args.quick, "worker_mib": MIB, "ns": ns, "memory": memory_facts(),
        "counted": ("forks: n children + the source workspace + the frozen template's processes "
                    "(template pids from its cgroup); independent: n workspaces. distinct = "
                    "physical pages mapped by any process of the family, each once (pagemap PFNs; "
                    "zero page excluded); cgroup = Σ memory_current of the cgroups involved"),
        "one_workspace": one, "forks": forks, "independent": indep,
        f"fork_total_n{nmax}_over_one_workspace": big_f["distinct_bytes"] / one["distinct_bytes"],
        f"fork_cgroup_n{nmax}_over_one_workspace": big_f["cgroup_bytes"] / one["cgroup_bytes"],
        f"independent_total_n{nmax}_over_fork_total_n{nmax}": big_i["distinct_bytes"] / big_f["distinct_bytes"],
        "fork_marginal_bytes_per_child": ((big_f["distinct_bytes"] - forks[0]["distinct_bytes"])
                                          / max(1, nmax - ns[0])),
        "independent_marginal_bytes_per_workspace": ((big_i["distinct_bytes"] - indep[0]["distinct_bytes"])
                                                     / max(1, nmax - ns[0])),
    }
    res["aims"] = {"n": nmax, "fork_total_over_one_workspace_le": 1.15,
                   "met": res[f"fork_total_n{nmax}_over_one_workspace"] <= 1.15,
                   "note": "" if nmax == 16 else "aim is stated for n=16; --quick stops at n=8"}
    plot(res)
    emit("fork_memory", res)


def plot(res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    ns = res["ns"]
    mib = lambda pts, k: [p[k] / _M for p in pts]  # noqa: E731
    ax.plot(ns, mib(res["independent"], "distinct_bytes"), "o-", color="#d62728",
            label="n independent workspaces: distinct pages")
    ax.plot(ns, mib(res["independent"], "cgroup_bytes"), "o--", color="#ff9896",
            label="n independent workspaces: Σ cgroup memory")
    ax.plot(ns, mib(res["forks"], "distinct_bytes"), "s-", color="#1f77b4",
            label="n forks (+ source + template): distinct pages")
    ax.plot(ns, mib(res["forks"], "cgroup_bytes"), "s--", color="#6baed6",
            label="n forks (+ source + template): Σ cgroup memory")
    one = res["one_workspace"]["distinct_bytes"] / _M
    ax.axhline(one * 1.15, color="k", lw=0.8, ls=":", label="aim: 1.15 × one workspace")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("n")
    ax.set_ylabel("MiB")
    ax.set_title(f"Memory: forks vs independent workspaces ({res['worker_mib']} MiB worker each)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path("fork_memory"), dpi=110)


if __name__ == "__main__":
    main()
