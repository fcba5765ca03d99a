"""Prefix-cache and speculation benchmark, A/B in one run.

Lookup: p50 of computing a node key (canonical call + xxh3-128) and of a metadata read from
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

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
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
