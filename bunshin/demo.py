"""``bunshin demo``: a small group rollout on the embedded default workspace, in every mode.

The task: a small Python project in /repo and a Python "kernel" process holding 64 MiB of
loaded data (think of a REPL or language server an agent keeps open); ``--group`` agents replay
traces that share their first calls (look around, run the code) and then diverge (each edits
and tests something of its own), with ``--think`` seconds of generation per step. The same
group runs with :class:`bunshin.rl.RolloutEngine` in each mode:

* ``fresh``   — one new workspace per rollout, setup replayed (today's way);
* ``criu``    — setup once, CRIU dump, a restore per rollout (when a CRIU ≥ 4 is found);
* ``fork``    — setup once, a live copy-on-write fork per rollout;
* ``bunshin`` — forks + prefix cache (shared calls run once) + speculation.

It prints a table (latency, peak memory, memory × time, ratios to fresh) and writes a PNG.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .cache.toolcall import ToolCall

KERNEL = ("import signal\ndata = bytearray(64 << 20)\n"
          "for i in range(0, len(data), 4096): data[i] = 1\n"
          "open('/tmp/kernel-ready', 'w').close()\nsignal.pause()\n")
CALC = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
TEST = ("import time\nfrom calc import add, mul\n\ntime.sleep(0.3)  # stands for a slow integration test\n\n\n"
        "def test_add():\n    assert add(2, 3) == 5\n\n\n"
        "def test_mul():\n    assert mul(2, 3) == 6\n\n\ntest_add(); test_mul(); print('tests ok')\n")
SETUP = (
    ToolCall("write_file", {"path": "/repo/calc.py", "content": CALC}),
    ToolCall("write_file", {"path": "/repo/test_calc.py", "content": TEST}),
    ToolCall("write_file", {"path": "/opt/kernel.py", "content": KERNEL}),
    ToolCall("bash", {"command": "(python3 /opt/kernel.py &) ; python3 -m compileall -q /repo"}),
)
SHARED = ["ls", "cat calc.py", "python3 test_calc.py"]
OWN = [
    ["grep -n def calc.py", "sed -i 's/a \\* b/a * b  # product/' calc.py", "python3 test_calc.py"],
    ["printf 'def sub(a, b):\\n    return a - b\\n' >> calc.py", "python3 -c 'import calc; print(calc.sub(5, 2))'",
     "python3 test_calc.py"],
    ["wc -l *.py", "python3 -c 'import calc; print(calc.mul(6, 7))'", "ls -la"],
    ["head -3 test_calc.py", "python3 -m py_compile calc.py && echo compiled", "python3 test_calc.py"],
]


def task():
    """The embedded default task."""
    from .rl import Task

    return Task("bunshin-demo", "Explore the calc project and improve it; keep the tests passing.",
                setup=SETUP, ready="test -e /tmp/kernel-ready", workdir="/repo", max_steps=16)


def traces(group: int) -> list[list[str]]:
    """One trace per rollout: the shared calls, then that rollout's own."""
    return [SHARED + OWN[i % len(OWN)] + [f"echo rollout {i} > notes.txt", "cat notes.txt"] for i in range(group)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--group", type=int, default=4, help="rollouts in the group (default 4)")
    p.add_argument("--think", type=float, default=0.2, help="seconds of generation per step (default 0.2)")
    p.add_argument("--modes", default=None, help="comma-separated modes (default: all available)")
    p.add_argument("--out", type=Path, default=Path("bunshin-demo.png"), help="PNG to write")
    p.add_argument("--json", action="store_true", help="print the figures as JSON at the end")


def _modes(arg: str | None) -> list[str]:
    from .criu_locate import find_criu
    from .rl.engine import MODES

    if arg:
        return [m.strip() for m in arg.split(",") if m.strip()]
    info = find_criu()
    have_criu = info is not None and info.usable
    return [m for m in MODES if m != "criu" or have_criu]


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from .rl import RolloutError
    from .rl.engine import RolloutEngine
    from .rl.policies import ReplayPolicy

    group = int(args.group)
    if group < 1:
        raise RolloutError(f"--group must be ≥ 1, got {group}")
    console = Console(width=None if Console().is_terminal else 110)
    tr = traces(group)
    results: dict[str, dict] = {}
    timelines: dict[str, tuple[list[float], list[int]]] = {}
    with Progress(console=console, transient=True) as prog:
        for mode in _modes(args.modes):
            bar = prog.add_task(f"{mode:8s} group of {group}", total=sum(map(len, tr)))
            pol = ReplayPolicy(tr, think_s=args.think, jitter=0.3, seed=0)
            with RolloutEngine(pol, task(), group, mode=mode,
                               on_turn=lambda *_, bar=bar: prog.advance(bar)) as eng:
                g = eng.run()
            results[mode] = g.as_dict()
            results[mode]["calls_failed"] = sum(t.exit_code != 0 for tj in g.trajectories for t in tj.turns)
            assert g.memory is not None  # the engine samples memory unless told not to
            timelines[mode] = (g.memory.times, g.memory.bytes)
    fresh = results.get("fresh")
    table = Table(title=f"bunshin demo: a group of {group} rollouts on the default workspace")
    for col in ("mode", "latency s", "peak MiB", "GB·s", "× fresh: lat / peak / GB·s", "cache hits", "failed"):
        table.add_column(col, justify="right")
    for mode, r in results.items():
        rel = " / ".join(f"{r[k] / fresh[k]:.2f}" if fresh and fresh[k] else "—"
                         for k in ("latency_s", "peak_bytes", "gb_s"))
        table.add_row(mode, f"{r['latency_s']:.2f}", f"{r['peak_bytes'] / 2**20:.0f}", f"{r['gb_s']:.3f}", rel,
                      str(r.get("cache", {}).get("hits", "")), str(r["calls_failed"]))
    console.print(table)
    console.print("fresh replays the setup in every rollout; the others set up once and share the 64 MiB "
                  "kernel's pages copy-on-write (memory: distinct physical pages, sampled every 100 ms).")
    _plot(results, timelines, group, args.out)
    console.print(f"plot: {args.out}")
    if args.json:
        print(json.dumps({"group": group, "modes": results}))
    bad = [m for m, r in results.items() if r["errors"] or r["calls_failed"]]
    return 1 if bad else 0


def _plot(results: dict, timelines: dict, group: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"fresh": "#7f7f7f", "criu": "#d62728", "fork": "#1f77b4", "bunshin": "#2ca02c"}
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.8))
    for m, (t, y) in timelines.items():
        a.plot(t, [v / 2**20 for v in y], label=m, color=colors.get(m))
    a.set_xlabel("seconds")
    a.set_ylabel("MiB held")
    a.set_title("Memory over time")
    a.legend()
    names = list(results)
    b.bar(names, [results[m]["latency_s"] for m in names], color=[colors.get(m) for m in names])
    b.set_title("Group latency (s)")
    c.bar(names, [results[m]["peak_bytes"] / 2**20 for m in names], color=[colors.get(m) for m in names])
    c.set_title("Peak memory (MiB)")
    fig.suptitle(f"{group} rollouts of one task: a workspace each vs forks of one set-up workspace")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
