"""Workspace runtime latency next to bare baselines measured in the same run.

create+close vs clone3 into the same fresh namespaces + exec /bin/true (the kernel's floor
for a namespaced process) and vs `unshare -mpniu --fork true` (what a shell script pays);
run("true") vs posix_spawn + wait of /bin/true from this process (the fork/exec floor).
Isolation side by side ("isolation" in the JSON): create+close, run("true") and tpl.fork(1) of
a snapshot of a small workspace (init + a bash session), isolation="trusted" and "sandbox"
interleaved in one loop, with the sandbox's cost as ratios (aim: <= 1.10 for run and fork).

usage: python bench/runtime.py [--quick]   (last stdout line: JSON; PNG in bench/out/)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, png_path, summary, timeit  # noqa: E402

import bunshin  # noqa: E402
from bunshin._core import _syscalls  # noqa: E402
from bunshin.runtime.workspace import _NS_FLAGS  # noqa: E402


def bare_namespaced_true() -> None:
    null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    try:
        pid, pidfd = _syscalls.clone_exec(_NS_FLAGS, "/bin/true", ["true"], [], (null, null, null), null)
    finally:
        os.close(null)
    os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
    os.close(pidfd)


def unshare_cli() -> None:
    subprocess.run(["unshare", "-mpniu", "--fork", "/bin/true"], check=True)


def spawn_true() -> None:
    pid = os.posix_spawn("/bin/true", ["true"], {})
    os.waitpid(pid, 0)


def create_close() -> None:
    bunshin.Workspace.create().close()


ISOLATIONS = ("trusted", "sandbox")


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _fork_closed(tpl) -> float:
    t = time.perf_counter()
    kids = tpl.fork(1)
    dt = time.perf_counter() - t
    for k in kids:
        k.close()
    time.sleep(0.005)  # the trainer's own work, in which the next child's init is made ahead
    return dt


def isolation_side_by_side(n_create: int, n_run: int, n_fork: int) -> dict:
    """Each measure for both isolations, alternating, so that noise falls on both alike."""
    times: dict = {iso: {"create_close": [], "run_true": [], "tpl_fork_1": []} for iso in ISOLATIONS}
    for _ in range(n_create):
        for iso in ISOLATIONS:
            times[iso]["create_close"].append(
                _timed(lambda: bunshin.Workspace.create(isolation=iso).close()))
    wss = {iso: bunshin.Workspace.create(isolation=iso) for iso in ISOLATIONS}
    try:
        for w in wss.values():
            w.shell()
        tpls = {iso: w.snapshot() for iso, w in wss.items()}
        try:
            for _ in range(3):  # warm-up
                for iso in ISOLATIONS:
                    _fork_closed(tpls[iso])
                    wss[iso].run("true")
            for i in range(max(n_run, n_fork)):
                for iso in ISOLATIONS:
                    if i < n_run:
                        times[iso]["run_true"].append(_timed(lambda: wss[iso].run("true")))
                    if i < n_fork:
                        times[iso]["tpl_fork_1"].append(_fork_closed(tpls[iso]))
        finally:
            for t in tpls.values():
                t.close()
    finally:
        for w in wss.values():
            w.close()
    out: dict = {iso: {k: summary(v) for k, v in m.items()} for iso, m in times.items()}
    out["sandbox_over_trusted_p50"] = {
        k: statistics.median(times["sandbox"][k]) / statistics.median(times["trusted"][k])
        for k in times["trusted"]}
    r = out["sandbox_over_trusted_p50"]
    out["aims"] = {"run_true_le_1.10": r["run_true"] <= 1.10, "tpl_fork_1_le_1.10": r["tpl_fork_1"] <= 1.10}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (well under 2 minutes)")
    ap.add_argument("--isolation-only", action="store_true",
                    help="only the trusted/sandbox side by side (JSON name runtime_isolation)")
    args = ap.parse_args()
    if args.isolation_only:
        n = (20, 200, 100) if args.quick else (60, 1000, 300)
        emit("runtime_isolation", {"isolation": isolation_side_by_side(*n)})
        return
    n_create, n_run = (30, 200) if args.quick else (200, 2000)

    res = {"create_close": summary(timeit(create_close, n_create)),
           "baseline_clone3_ns_true": summary(timeit(bare_namespaced_true, n_create)),
           "baseline_unshare_cli": summary(timeit(unshare_cli, n_create))}
    with bunshin.Workspace.create() as ws:
        run_t = timeit(lambda: ws.run("true"), n_run)
        exec_t = timeit(lambda: ws.exec(["/bin/true"]), n_run)
        sh = ws.shell()
        shell_t = timeit(lambda: sh.run("true"), n_run)
    base_t = timeit(spawn_true, n_run)
    res.update({"run_true": summary(run_t), "exec_true": summary(exec_t),
                "shell_run_true": summary(shell_t), "baseline_spawn_true": summary(base_t)})
    res["ratios"] = {
        "create_close_over_clone3_ns": res["create_close"]["p50_ms"] / res["baseline_clone3_ns_true"]["p50_ms"],
        "run_true_overhead_ms": res["run_true"]["p50_ms"] - res["baseline_spawn_true"]["p50_ms"],
        "exec_true_overhead_ms": res["exec_true"]["p50_ms"] - res["baseline_spawn_true"]["p50_ms"],
    }
    res["aims"] = {"create_p50_ms_le": 50, "run_true_overhead_ms_le": 2,
                   "create_met": res["create_close"]["p50_ms"] <= 50,
                   "run_met": res["ratios"]["run_true_overhead_ms"] <= 2}
    res["isolation"] = isolation_side_by_side(*((20, 200, 100) if args.quick else (60, 1000, 300)))
    plot(res, run_t, exec_t, shell_t, base_t)
    emit("runtime", res)


def plot(res: dict, run_t: list, exec_t: list, shell_t: list, base_t: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = ["create_close", "baseline_clone3_ns_true", "baseline_unshare_cli"]
    labels = ["Workspace\ncreate+close", "clone3 new ns\n+ exec true", "unshare CLI\n+ true"]
    p50 = [res[k]["p50_ms"] for k in names]
    p95 = [res[k]["p95_ms"] for k in names]
    x = range(len(names))
    a.bar(x, p50, color=["#1f77b4", "#999", "#bbb"], label="p50")
    a.scatter(x, p95, color="k", marker="_", s=400, label="p95")
    a.set_xticks(list(x), labels)
    a.set_ylabel("ms")
    a.set_title("Workspace lifetime vs namespace baselines")
    a.legend()
    ms = lambda xs: [v * 1e3 for v in xs]  # noqa: E731
    b.boxplot([ms(base_t), ms(exec_t), ms(run_t), ms(shell_t)], showfliers=False,
              tick_labels=["posix_spawn\ntrue (host)", "ws.exec\n[true]", "ws.run\n'true'", "shell.run\n'true'"])
    b.set_ylabel("ms")
    b.set_title("Tool call latency vs fork/exec floor")
    fig.tight_layout()
    fig.savefig(png_path("runtime"), dpi=110)


if __name__ == "__main__":
    main()
