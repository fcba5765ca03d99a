"""What the sandbox (isolation="sandbox": bunshin.sandbox) costs: create, run("true"),
tpl.fork(1) and ws.fork(1) of a small workspace (init + a bash session), with isolation
"trusted" and "sandbox" side by side, interleaved in one loop; the JSON holds each p50 and the
sandbox/trusted ratio (aim: ≤ 1.10 for run and tpl.fork(1)).

usage: python bench/isolation.py [--quick]   (last stdout line: JSON)
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, summary  # noqa: E402

import bunshin  # noqa: E402

MODES = ("trusted", "sandbox")


def timed(fn) -> float:
    """Seconds ``fn`` takes; what it returns (a child) is closed after the timing."""
    t = time.perf_counter()
    made = fn()
    took = time.perf_counter() - t
    if made is not None:
        made.close()
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    n = 60 if ap.parse_args().quick else 300
    times: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    ws = {m: bunshin.Workspace.create(isolation=m) for m in MODES}
    for m in MODES:
        ws[m].shell()
        for _ in range(20):
            ws[m].run("true")
    tpl = {m: ws[m].snapshot() for m in MODES}

    steps = [("run_true", n, lambda m: ws[m].run("true") and None),
             ("tpl_fork_1", n // 5, lambda m: tpl[m].fork(1)[0]),
             ("ws_fork_1", n // 15, lambda m: ws[m].fork(1)[0]),
             ("create", n // 15, lambda m: bunshin.Workspace.create(isolation=m))]
    try:
        for name, count, fn in steps:
            for i in range(count):
                for m in (MODES if i % 2 else MODES[::-1]):  # neither always goes first
                    times[m].setdefault(name, []).append(timed(functools.partial(fn, m)))
    finally:
        for m in MODES:
            tpl[m].close()
            ws[m].close()
    result: dict = {}
    for name, *_ in steps:
        off, on = summary(times["trusted"][name]), summary(times["sandbox"][name])
        result[name] = {"trusted": off, "sandbox": on,
                        "ratio_p50": on["p50_ms"] / off["p50_ms"]}
        print(f"{name:13s} trusted {off['p50_ms']:8.3f} ms  sandbox {on['p50_ms']:8.3f} ms  "
              f"ratio {result[name]['ratio_p50']:.3f}")
    emit("isolation", result)


if __name__ == "__main__":
    main()
