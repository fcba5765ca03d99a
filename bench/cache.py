"""Prefix-cache and speculation benchmark, A/B in one run.

Group replay: a group of rollouts of one task sharing their first calls, executed plainly and
through a PrefixCache: wall time, hit rate, seconds saved. Lookup: p50 of computing a node key (canonical call + xxh3-128) and of a metadata read from
LMDB, for a trie of ``--nodes`` recorded calls. Speculation: a rollout of ``--steps`` bash calls
(each ``sleep --call`` + a counter write) with ``--think`` seconds of policy generation before
each call, run plainly and with a SpeculativeExecutor whose predictor is right with
probability ``--accuracy``; both wall times, hit rate, seconds saved and CPU wasted.

usage: python bench/cache.py [--quick]   (last stdout line: JSON; PNG in bench/out/)
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, png_path, summary, timeit  # noqa: E402

import bunshin  # noqa: E402
from bunshin.cache.store import MetaStore  # noqa: E402
from bunshin.cache.toolcall import ToolCall, canonical, child_key, root_key  # noqa: E402


def lookup_costs(nodes: int) -> dict:
    root = root_key("bench")
    calls = [ToolCall("bash", {"command": f"grep -rn pattern{i} src/"}) for i in range(nodes)]
    keys = [child_key(root, c) for c in calls]
    with tempfile.TemporaryDirectory() as d:
        store = MetaStore(Path(d) / "m.lmdb")
        t = time.perf_counter()
        for k, c in zip(keys, calls):
            store.visit(root, k, canonical(c.name, c.args))
        insert_s = (time.perf_counter() - t) / nodes
        it = iter(range(10**9))
        key_t = timeit(lambda: child_key(root, calls[next(it) % nodes]), 2000)
        it2 = iter(range(10**9))
        get_t = timeit(lambda: store.get(keys[next(it2) % nodes]), 2000)
    return {"nodes": nodes, "key": summary(key_t), "lmdb_get": summary(get_t),
            "insert_us": insert_s * 1e6}


def group_replay(group: int, steps: int, shared: int, cost: float) -> dict:
    """A group of rollouts of one task whose first ``shared`` calls are identical: plain
    execution vs a PrefixCache (every call snapshotted), same traces, same checks."""
    def trace(r: int) -> list[str]:
        return [f"sleep {cost}; echo s{i} >> /tmp/log" if i < shared else
                f"sleep {cost}; echo r{r}-{i} >> /tmp/log" for i in range(steps)]

    def expected(r: int) -> bytes:
        return "".join(f"s{i}\n" if i < shared else f"r{r}-{i}\n" for i in range(steps)).encode()

    t0 = time.monotonic()
    for r in range(group):
        with bunshin.Workspace.create() as ws:
            sh = ws.shell()
            for c in trace(r):
                sh.run(c)
            assert ws.read_file("/tmp/log") == expected(r)
    plain = time.monotonic() - t0
    with tempfile.TemporaryDirectory() as d, \
            bunshin.PrefixCache(Path(d) / "c.lmdb", memory_budget=8 << 30, snapshot=0.0) as cache:
        t0 = time.monotonic()
        for r in range(group):
            with bunshin.Workspace.create() as ws:
                cw = cache.rollout(ws, task_id="bench")
                for c in trace(r):
                    cw.call(c)
                assert ws.read_file("/tmp/log") == expected(r)
        cached = time.monotonic() - t0
        st = cache.stats
    return {"group": group, "steps": steps, "shared_prefix": shared, "call_s": cost,
            "plain_s": plain, "cached_s": cached, "ratio": cached / plain,
            "hit_rate": st.hits / max(st.hits + st.misses, 1), "hits": st.hits, "misses": st.misses,
            "saved_s": st.saved_seconds}


def _run(trace: list[str], think: float, ex) -> float:
    with bunshin.Workspace.create() as ws:
        sh = ws.shell()
        t0 = time.monotonic()
        for i, cmd in enumerate(trace):
            if ex is not None:
                ex.prefetch(ws, trace[:i])
            time.sleep(think)  # the policy generates
            if ex is not None:
                ex.call(ws, cmd)
            else:
                sh.run(cmd)
        dt = time.monotonic() - t0
        assert ws.read_file("/tmp/steps").split() == [str(i).encode() for i in range(len(trace))]
        return dt


def speculation(steps: int, think: float, call: float, accuracy: float, seed: int) -> dict:
    trace = [f"sleep {call}; echo {i} >> /tmp/steps" for i in range(steps)]
    rng = random.Random(seed)

    def predictor(history: list) -> list[str]:
        i = len(history)
        return [trace[i] if rng.random() < accuracy else f"echo wrong{i} > /tmp/wrong"]

    plain = _run(trace, think, None)
    ex = bunshin.SpeculativeExecutor(predictor, max_inflight=1)
    spec = _run(trace, think, ex)
    st = ex.stats
    return {"steps": steps, "think_s": think, "call_s": call, "accuracy": accuracy,
            "plain_s": plain, "speculative_s": spec, "ratio": spec / plain,
            "hit_rate": st.hits / max(st.hits + st.misses, 1), "saved_s": st.saved_seconds,
            "wasted_cpu_s": st.wasted_cpu_seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small trie, short think times")
    ap.add_argument("--accuracy", type=float, default=0.75)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    res = {"lookup": lookup_costs(2000 if a.quick else 100_000)}
    res["group_replay"] = (group_replay(3, 4, 2, 0.2) if a.quick else group_replay(8, 8, 4, 1.0))
    thinks = [0.2, 0.5] if a.quick else [1, 2, 5, 10]
    res["speculation"] = [speculation(4 if a.quick else 8, t, 0.3 if a.quick else 1.0, a.accuracy, a.seed)
                          for t in thinks]
    res["aims"] = {"lookup_p50_us_le": 5, "key_met": res["lookup"]["key"]["p50_ms"] * 1e3 <= 5}
    _plot(res)
    emit("cache", res)


def _plot(res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, c, b) = plt.subplots(1, 3, figsize=(14, 3.8))
    g = res["group_replay"]
    c.bar(["plain", "prefix cache"], [g["plain_s"], g["cached_s"]], color=["#999", "#2ca02c"])
    c.set_ylabel("group wall s")
    c.set_title(f"{g['group']} rollouts, {g['shared_prefix']}/{g['steps']} calls shared")
    lk = res["lookup"]
    a.bar(["node key\n(xxh3-128)", "LMDB get"], [lk["key"]["p50_ms"] * 1e3, lk["lmdb_get"]["p50_ms"] * 1e3])
    a.set_ylabel("µs (p50)")
    a.set_title(f"Lookup, {lk['nodes']} nodes")
    sp = res["speculation"]
    x = range(len(sp))
    b.bar([i - 0.2 for i in x], [s["plain_s"] for s in sp], width=0.4, label="plain")
    b.bar([i + 0.2 for i in x], [s["speculative_s"] for s in sp], width=0.4, label="speculative")
    b.set_xticks(list(x), [f"think {s['think_s']} s" for s in sp])
    b.set_ylabel("rollout wall s")
    b.set_title("Speculation")
    b.legend()
    fig.tight_layout()
    fig.savefig(png_path("cache"), dpi=110)


if __name__ == "__main__":
    main()
