"""CRIU dump and restore of the same workspace made trusted and sandbox, side by side.

For each worker size S (MiB of distinct pages a Python process holds; 0: no worker), one
workspace per isolation is built alike (a bash session + the worker) and
``dump_workspace`` + ``restore_workspace`` run on each in turn, ``reps`` times, alternating
isolations so that load on the machine falls on both alike; each image is removed and each
restored workspace closed after its round. Reported: medians of dump, restore and both, per
isolation, and the sandbox/trusted ratios.

usage: python bench/criu_isolation.py [--quick]   (last stdout line: JSON; PNG in bench/out/)
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, png_path
from _workloads import build_workspace

import bunshin
from bunshin import criu
from bunshin.criu import runner

ISOLATIONS = ("trusted", "sandbox")
def one_round(ws: bunshin.Workspace, img: Path) -> tuple[float, float]:
    t = time.perf_counter()
    criu.dump_workspace(ws, img)
    dump_s = time.perf_counter() - t
    t = time.perf_counter()
    w = criu.restore_workspace(img)
    restore_s = time.perf_counter() - t
    w.close()
    shutil.rmtree(img)
    return dump_s, restore_s


def side_by_side(mib: int, reps: int, tmp: Path) -> dict:
    wss = {iso: build_workspace(mib, distinct=True, isolation=iso).ws for iso in ISOLATIONS}
    times: dict[str, dict[str, list[float]]] = {iso: {"dump": [], "restore": []} for iso in ISOLATIONS}
    try:
        for i in range(reps + 1):  # the first round of each warms caches up, and is dropped
            for iso in ISOLATIONS if i % 2 else reversed(ISOLATIONS):
                d, r = one_round(wss[iso], tmp / f"{iso}-{mib}-{i}")
                if i:
                    times[iso]["dump"].append(d)
                    times[iso]["restore"].append(r)
    finally:
        for ws in wss.values():
            ws.close()
    out: dict = {"worker_mib": mib, "reps": reps}
    for iso in ISOLATIONS:
        t = times[iso]
        both = [d + r for d, r in zip(t["dump"], t["restore"])]
        out[iso] = {"dump_ms": statistics.median(t["dump"]) * 1e3,
                    "restore_ms": statistics.median(t["restore"]) * 1e3,
                    "dump_restore_ms": statistics.median(both) * 1e3}
    for k in ("dump_ms", "restore_ms", "dump_restore_ms"):
        out[f"sandbox_over_trusted_{k[:-3]}"] = out["sandbox"][k] / out["trusted"][k]
    print(f"{mib:4d} MiB: " + ", ".join(
        f"{iso} dump {out[iso]['dump_ms']:.0f} + restore {out[iso]['restore_ms']:.0f} ms"
        for iso in ISOLATIONS) + f" (sandbox/trusted {out['sandbox_over_trusted_dump_restore']:.2f})",
        file=sys.stderr, flush=True)
    return out


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    width = 0.2
    for j, (iso, part) in enumerate((i, p) for i in ISOLATIONS for p in ("dump", "restore")):
        xs = [k + (j - 1.5) * width for k in range(len(rows))]
        ax.bar(xs, [r[iso][f"{part}_ms"] for r in rows], width, label=f"{iso} {part}")
    ax.set_xticks(range(len(rows)), [f"{r['worker_mib']} MiB worker" for r in rows])
    ax.set_ylabel("median ms")
    ax.set_title("CRIU dump and restore of one workspace, trusted vs sandbox")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path("criu_isolation"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    info = runner.criu()
    sizes = [0, 64] if args.quick else [0, 64, 256]
    reps = 5 if args.quick else 11
    tmp = Path(tempfile.mkdtemp(prefix="bunshin-bench-criu-iso-"))
    try:
        rows = [side_by_side(mib, reps, tmp) for mib in sizes]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    plot(rows)
    emit("criu_isolation", {"quick": args.quick, "criu": runner.version_string(info), "sizes": rows,
                            "counted": "wall clock medians on a shared 2-core VM; rounds alternate "
                                       "isolations; the first round of each is dropped"})


if __name__ == "__main__":
    main()
