"""Speculation benchmark: hit rate and net wall-time saving on a replayed trace.

A rollout of ``--steps`` bash calls (each ``sleep --call`` seconds, plus a counter write) with
``--think`` seconds of policy "generation" before each call. Run A: calls executed plainly.
Run B: a SpeculativeExecutor whose predictor is right with probability ``--accuracy``
prefetches during the think time. Prints JSON (machine, both wall times, counters).

    python bench/cache.py --steps 8 --think 1 --call 0.5 --accuracy 0.75
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time

import bunshin


def _trace(steps: int, call: float) -> list[str]:
    return [f"sleep {call}; echo {i} >> /tmp/steps" for i in range(steps)]


def _run(trace: list[str], think: float, ex: bunshin.SpeculativeExecutor | None) -> float:
    with bunshin.Workspace.create() as ws:
        ws.shell()
        t0 = time.monotonic()
        for i, cmd in enumerate(trace):
            if ex is not None:
                ex.prefetch(ws, trace[:i])
            time.sleep(think)  # the policy generates
            if ex is not None:
                ex.call(ws, cmd)
            else:
                ws._shells[0].run(cmd)
        dt = time.monotonic() - t0
        assert ws.read_file("/tmp/steps").split() == [str(i).encode() for i in range(len(trace))]
        return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--think", type=float, default=0.5)
    ap.add_argument("--call", type=float, default=0.3)
    ap.add_argument("--accuracy", type=float, default=0.75)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    trace = _trace(a.steps, a.call)
    rng = random.Random(a.seed)

    def predictor(history: list) -> list[str]:
        i = len(history)
        return [trace[i] if rng.random() < a.accuracy else f"echo wrong{i} > /tmp/wrong"]

    plain = _run(trace, a.think, None)
    ex = bunshin.SpeculativeExecutor(predictor, max_inflight=1)
    spec = _run(trace, a.think, ex)
    st = ex.stats
    print(json.dumps({
        "machine": {"kernel": platform.release(), "cpus": os.cpu_count()},
        "args": vars(a), "plain_seconds": round(plain, 3), "speculative_seconds": round(spec, 3),
        "net_saving_seconds": round(plain - spec, 3),
        "hit_rate": st.hits / max(st.hits + st.misses, 1), "hits": st.hits, "misses": st.misses,
        "saved_seconds": round(st.saved_seconds, 3), "wasted_cpu_seconds": round(st.wasted_cpu_seconds, 4),
    }, indent=1))


if __name__ == "__main__":
    main()
