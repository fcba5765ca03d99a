"""``bunshin demo``: a small agent-style group rollout on the embedded default workspace, run
two ways side by side.

* ``fresh`` — today's one-workspace-per-rollout: each of ``--group`` rollouts creates its own
  workspace, replays the task's setup (write a small Python project, start a Python "kernel"
  holding 64 MiB of loaded data, run the project), then takes its own exploring and editing
  steps in a persistent shell.
* ``fork`` — Bunshin: the setup runs once, the set-up workspace is snapshotted, and every
  rollout continues on a live fork of it (same processes, same shell session, memory shared
  copy-on-write).

It prints a table, and writes a PNG with the time and memory of each mode.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

KERNEL = ("import signal\ndata = bytearray(64 << 20)\n"
          "for i in range(0, len(data), 4096): data[i] = 1\n"
          "open('/tmp/kernel-ready', 'w').close()\nsignal.pause()\n")
SETUP = [
    ("write", "/repo/calc.py", "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"),
    ("write", "/repo/test_calc.py",
     "from calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
     "def test_mul():\n    assert mul(2, 3) == 6\n"),
    ("write", "/kernel.py", KERNEL),
    ("spawn", "python3 /kernel.py", None),
    ("bash", "cd /repo && ls", None),
    ("bash", "cd /repo && python3 -c 'import calc; print(calc.add(1, 2))'", None),
]
STEPS = [
    ["grep -n def calc.py", "sed -i 's/a \\* b/a * b  # product/' calc.py", "python3 test_calc.py && echo ok"],
    ["cat calc.py", "printf 'def sub(a, b):\\n    return a - b\\n' >> calc.py", "python3 -c 'import calc; print(calc.sub(5, 2))'"],
    ["wc -l *.py", "python3 -c 'import calc; print(calc.mul(6, 7))'", "ls -la"],
    ["head -3 test_calc.py", "python3 -m py_compile calc.py && echo compiled", "pwd"],
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--group", type=int, default=4, help="rollouts in the group (default 4)")
    p.add_argument("--out", type=Path, default=Path("bunshin-demo.png"), help="PNG to write")
    p.add_argument("--json", action="store_true", help="print the figures as JSON at the end")


def _setup(ws, sh) -> float:
    t = time.perf_counter()
    for kind, arg, body in SETUP:
        if kind == "write":
            ws.write_file(arg, body)
        elif kind == "spawn":
            ws.spawn(arg.split())
        else:
            sh.run(arg)
    while not ws.run("test -e /tmp/kernel-ready").ok:
        time.sleep(0.01)
    return time.perf_counter() - t


def _steps(sh, i: int) -> tuple[float, int]:
    t = time.perf_counter()
    sh.run("cd /repo")
    ok = sum(sh.run(cmd).ok for cmd in STEPS[i % len(STEPS)])
    return time.perf_counter() - t, ok


def _fresh(group: int) -> dict:
    import bunshin

    start = time.perf_counter()
    wss, setup_s, own_s, ok = [], 0.0, 0.0, 0
    try:
        for i in range(group):
            ws = bunshin.Workspace.create(hostname=f"rollout-{i}")
            wss.append(ws)
            sh = ws.shell()
            setup_s += _setup(ws, sh)
            dt, k = _steps(sh, i)
            own_s += dt
            ok += k
        mem = bunshin.memory.family_usage(wss, pss=False).total_bytes
    finally:
        for ws in wss:
            ws.close()
    return {"wall_s": time.perf_counter() - start, "setup_s": setup_s, "own_s": own_s,
            "calls_ok": ok, "memory_bytes": mem}


def _fork(group: int) -> dict:
    import bunshin

    start = time.perf_counter()
    base = bunshin.Workspace.create(hostname="base")
    kids = []
    try:
        sh = base.shell()
        setup_s = _setup(base, sh)
        t = time.perf_counter()
        tpl = base.snapshot()
        kids = tpl.fork(group)
        fork_s = time.perf_counter() - t
        own_s, ok = 0.0, 0
        for i, k in enumerate(kids):
            dt, n = _steps(k._shells[0], i)
            own_s += dt
            ok += n
        template = {"template": tpl.host_pids()}
        groups = {w.id: w.host_pids() for w in kids}
        mem = bunshin.memory.pids_usage({**groups, **template}, pss=False).total_bytes
        tpl.close()
    finally:
        for k in kids:
            k.close()
        base.close()
    return {"wall_s": time.perf_counter() - start, "setup_s": setup_s, "fork_s": fork_s,
            "own_s": own_s, "calls_ok": ok, "memory_bytes": mem}


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console()
    group = max(1, int(args.group))
    with Progress(console=console, transient=True) as prog:
        task = prog.add_task(f"group of {group}: fresh workspaces, then forks", total=2)
        fresh = _fresh(group)
        prog.advance(task)
        fork = _fork(group)
        prog.advance(task)
    table = Table(title=f"bunshin demo: a group of {group} rollouts on the default workspace")
    for col in ("mode", "wall s", "setup s", "fork s", "own steps s", "calls ok", "memory MiB"):
        table.add_column(col, justify="right")
    for name, r in (("fresh", fresh), ("fork", fork)):
        table.add_row(name, f"{r['wall_s']:.3f}", f"{r['setup_s']:.3f}", f"{r.get('fork_s', 0):.3f}",
                      f"{r['own_s']:.3f}", str(r["calls_ok"]), f"{r['memory_bytes'] / 2**20:.1f}")
    console.print(table)
    console.print(f"fork vs fresh: wall {fork['wall_s'] / fresh['wall_s']:.2f}×, "
                  f"memory {fork['memory_bytes'] / fresh['memory_bytes']:.2f}× "
                  f"(the setup ran once instead of {group}×; the 64 MiB kernel is shared).")
    _plot(fresh, fork, group, args.out)
    console.print(f"plot: {args.out}")
    if args.json:
        print(json.dumps({"group": group, "fresh": fresh, "fork": fork}))
    want = group * len(STEPS[0])
    return 0 if fresh["calls_ok"] == want and fork["calls_ok"] == want else 1


def _plot(fresh: dict, fork: dict, group: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    modes = ["fresh", "fork"]
    bottom = [0.0, 0.0]
    for key, color in (("setup_s", "#d62728"), ("fork_s", "#999999"), ("own_s", "#1f77b4")):
        vals = [fresh.get(key, 0.0), fork.get(key, 0.0)]
        a.bar(modes, vals, bottom=bottom, color=color, label=key[:-2])
        bottom = [x + y for x, y in zip(bottom, vals)]
    a.set_ylabel("seconds (summed over rollouts)")
    a.set_title("Time")
    a.legend()
    b.bar(modes, [fresh["memory_bytes"] / 2**20, fork["memory_bytes"] / 2**20], color=["#777", "#2ca02c"])
    b.set_ylabel("MiB (distinct pages)")
    b.set_title("Memory of the group")
    fig.suptitle(f"{group} rollouts: one workspace each vs forks of one set-up workspace")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
