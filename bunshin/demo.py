"""``bunshin demo``: a small agent-style group rollout on the embedded default workspace.

Each of ``--group`` rollouts gets its own workspace, replays the task's setup (write a small
Python project, run its tests), then takes its own exploring and editing steps in a
persistent shell — today's one-workspace-per-rollout baseline, with per-call timings. Forks
and the prefix cache (later issues) make the shared setup free; this demo is what they beat.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SETUP = [
    ("write", "/repo/calc.py", "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"),
    ("write", "/repo/test_calc.py",
     "from calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
     "def test_mul():\n    assert mul(2, 3) == 6\n"),
    ("bash", "cd /repo && ls"),
    ("bash", "cd /repo && python3 -c 'import calc; print(calc.add(1, 2))'"),
]
STEPS = [
    ["grep -n def calc.py", "sed -i 's/a \\* b/a * b  # product/' calc.py", "python3 test_calc.py && echo ok"],
    ["cat calc.py", "echo 'def sub(a, b):\n    return a - b' >> calc.py", "python3 -c 'import calc; print(calc.sub(5, 2))'"],
    ["wc -l *.py", "python3 -c 'import calc; print(calc.mul(6, 7))'", "git --version || true"],
    ["head -3 test_calc.py", "python3 -m py_compile calc.py && echo compiled", "ls -la"],
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--group", type=int, default=4, help="rollouts in the group (default 4)")
    p.add_argument("--out", type=Path, default=Path("bunshin-demo.png"), help="PNG to write")
    p.add_argument("--json", action="store_true", help="print the figures as JSON at the end")


def _rollout(i: int) -> dict:
    import bunshin

    t0 = time.perf_counter()
    calls = []
    with bunshin.Workspace.create(hostname=f"rollout-{i}") as ws:
        t_create = time.perf_counter() - t0
        sh = ws.shell()
        for kind, *args in SETUP:
            t = time.perf_counter()
            if kind == "write":
                ws.write_file(args[0], args[1])
                ok = True
            else:
                ok = sh.run(args[0]).ok
            calls.append(("setup", kind, time.perf_counter() - t, ok))
        sh.run("cd /repo")
        for cmd in STEPS[i % len(STEPS)]:
            t = time.perf_counter()
            r = sh.run(cmd)
            calls.append(("own", cmd, time.perf_counter() - t, r.ok))
        mem = ws.cgroup.stats().memory_peak or 0
    return {"rollout": i, "create_s": t_create, "total_s": time.perf_counter() - t0,
            "calls": calls, "peak_bytes": mem}


def main(args: argparse.Namespace) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console()
    group = max(1, int(args.group))
    results = []
    start = time.perf_counter()
    with Progress(console=console) as prog, ThreadPoolExecutor(min(group, 4)) as ex:
        task = prog.add_task(f"{group} rollouts, one workspace each", total=group)
        for r in ex.map(_rollout, range(group)):
            results.append(r)
            prog.advance(task)
    wall = time.perf_counter() - start

    table = Table(title="bunshin demo: one workspace per rollout")
    for col in ("rollout", "create ms", "setup ms", "own steps ms", "calls ok", "peak MiB"):
        table.add_column(col, justify="right")
    for r in results:
        setup = sum(c[2] for c in r["calls"] if c[0] == "setup") * 1e3
        own = sum(c[2] for c in r["calls"] if c[0] == "own") * 1e3
        ok = sum(c[3] for c in r["calls"])
        table.add_row(str(r["rollout"]), f"{r['create_s'] * 1e3:.1f}", f"{setup:.1f}", f"{own:.1f}",
                      f"{ok}/{len(r['calls'])}", f"{r['peak_bytes'] / 2**20:.1f}")
    console.print(table)
    shared = sum(sum(c[2] for c in r["calls"] if c[0] == "setup") for r in results)
    console.print(f"group wall time {wall:.3f} s; {shared * 1e3:.1f} ms of it re-ran the same setup "
                  f"{group}× — the work forks and the prefix cache remove.")
    _plot(results, args.out)
    console.print(f"plot: {args.out}")
    if args.json:
        print(json.dumps({"group": group, "wall_s": wall, "setup_repeated_s": shared,
                          "rollouts": [{k: v for k, v in r.items() if k != "calls"} for r in results]}))
    return 0 if all(all(c[3] for c in r["calls"]) for r in results) else 1


def _plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for r in results:
        left = r["create_s"]
        ax.barh(r["rollout"], left, color="#999", label="create" if r["rollout"] == 0 else None)
        for kind, _name, dt, _ok in r["calls"]:
            ax.barh(r["rollout"], dt, left=left, color="#d62728" if kind == "setup" else "#1f77b4",
                    label=None)
            left += dt
    ax.barh([], [], color="#d62728", label="repeated setup")
    ax.barh([], [], color="#1f77b4", label="rollout's own steps")
    ax.set_xlabel("seconds")
    ax.set_ylabel("rollout")
    ax.legend(loc="lower right")
    ax.set_title("Per-rollout time, one workspace each")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
