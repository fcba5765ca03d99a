"""One trainer, many workspaces: live children of one template (and independent workspaces),
each answering tool calls from 32 threads and from asyncio, in a trainer that already holds
more than 1024 descriptors.

The workload is the issue's: a template of a workspace with a bash session and a Python
process holding 64 MiB. Per size n, measured in the same run:
  * fork ms per child (tpl.fork(25) until n children live);
  * the trainer's cost per workspace: descriptors and threads (their growth over n), RSS;
  * `run("echo ok")` latency p50/p99 and calls per second with every child busy: 32 threads
    calling round-robin, then one event loop keeping 256 `arun` calls in flight (so its
    latency includes its queue); every child answers at least once;
  * total memory: distinct physical pages of the whole family (a page counted once), the
    template's frozen processes included;
  * close ms per child; then 32 threads asking tpl.fork(1) at once: latency, how far apart
    the threads finish (forks are served in the order asked), the fork thread's CPU per fork;
  * failures (a call not answered "ok", an exception): must be 0.
Then the same calls on independent workspaces (each built from scratch), for comparison.

usage: python bench/load.py [--quick]   (quick: 100 and 300 children, 20 independent; under
2 minutes. Last stdout line: JSON; PNG in bench/out/)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, memory_facts, png_path  # noqa: E402
from _workloads import build_workspace  # noqa: E402

from bunshin.memory import pids_usage  # noqa: E402

MIB = 64
HELD_FDS = 1100
THREADS = 32
IN_FLIGHT = 256
_M = 1 << 20


def _count(path: str) -> int:
    return len(os.listdir(path))


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] * 1e3


def _latencies(xs: list[float], wall: float) -> dict:
    return {"n": len(xs), "p50_ms": statistics.median(xs) * 1e3, "p99_ms": _pct(xs, 0.99),
            "calls_per_s": len(xs) / wall}


def calls_from_threads(wss: list, calls: int) -> tuple[dict, int]:
    """``calls`` runs (at least one per workspace) from THREADS threads, round-robin."""
    lat: list[float] = []
    failures = [0]
    lock = threading.Lock()
    nxt = iter(range(max(calls, len(wss))))

    def worker() -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            t = time.perf_counter()
            try:
                ok = wss[i % len(wss)].run("echo ok").stdout == b"ok\n"
            except Exception:  # noqa: BLE001 - counted
                ok = False
            with lock:
                lat.append(time.perf_counter() - t)
                failures[0] += not ok

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return _latencies(lat, time.perf_counter() - t0), failures[0]


def calls_from_asyncio(wss: list, calls: int) -> tuple[dict, int]:
    """The same calls from one event loop, IN_FLIGHT at a time."""
    lat: list[float] = []

    async def one(i: int, sem: asyncio.Semaphore) -> bool:
        async with sem:
            t = time.perf_counter()
            try:
                ok = (await wss[i % len(wss)].arun("echo ok")).stdout == b"ok\n"
            except Exception:  # noqa: BLE001 - counted
                ok = False
            lat.append(time.perf_counter() - t)
            return ok

    async def main() -> list[bool]:
        sem = asyncio.Semaphore(IN_FLIGHT)
        return await asyncio.gather(*(one(i, sem) for i in range(max(calls, len(wss)))))

    t0 = time.perf_counter()
    oks = asyncio.run(main())
    return _latencies(lat, time.perf_counter() - t0), oks.count(False)


def _engine_cpu_s() -> float:
    """CPU seconds of the fork engine's thread (every fork's ptrace work runs there)."""
    tid = next((t.native_id for t in threading.enumerate() if t.name == "bunshin-fork"), None)
    if tid is None:
        return 0.0
    st = Path(f"/proc/self/task/{tid}/stat").read_text()
    f = st[st.rindex(")") + 2:].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def forks_from_threads(tpl, threads: int, per_thread: int) -> dict:
    """``threads`` threads each asking ``per_thread`` tpl.fork(1) at once (each child closed at
    once): latency under contention, fairness (how far apart the threads finish), and the fork
    thread's CPU per fork."""
    lat: list[float] = []
    done_at: list[float] = []
    lock = threading.Lock()
    failures = [0]

    def worker() -> None:
        for _ in range(per_thread):
            t = time.perf_counter()
            try:
                (k,) = tpl.fork(1)
                k.close()
            except Exception:  # noqa: BLE001 - counted
                with lock:
                    failures[0] += 1
                continue
            with lock:
                lat.append(time.perf_counter() - t)
        with lock:
            done_at.append(time.perf_counter())

    cpu0, t0 = _engine_cpu_s(), time.perf_counter()
    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    forks = threads * per_thread
    return {"threads": threads, "forks": forks, "fork_and_close": _latencies(lat, wall),
            "threads_finish_spread_s": max(done_at) - min(done_at), "wall_s": wall,
            "engine_cpu_ms_per_fork": (_engine_cpu_s() - cpu0) * 1e3 / forks,
            "failures": failures[0]}


def measure_children(ns: list[int], calls: int) -> list[dict]:
    ld = build_workspace(MIB)
    points = []
    kids: list = []
    try:
        tpl = ld.ws.snapshot()
        try:
            fds0, threads0, rss0 = _count("/proc/self/fd"), _count("/proc/self/task"), _rss()
            for n in ns:
                t = time.perf_counter()
                while len(kids) < n:
                    kids += tpl.fork(min(25, n - len(kids)))
                fork_ms = (time.perf_counter() - t) * 1e3 / (n - (points[-1]["n"] if points else 0))
                threaded, f1 = calls_from_threads(kids, calls)
                aio, f2 = calls_from_asyncio(kids, calls)
                groups = {"template": tpl.host_pids(), "source": ld.ws.host_pids(),
                          **{k.id: k.host_pids() for k in kids}}
                u = pids_usage(groups, pss=False)
                points.append({
                    "n": n, "fork_ms_per_child": fork_ms, "run_threads": threaded, "run_asyncio": aio,
                    "fds_per_workspace": (_count("/proc/self/fd") - fds0) / n,
                    "threads_per_workspace": (_count("/proc/self/task") - threads0) / n,
                    "trainer_rss_bytes": _rss(), "trainer_rss_growth_per_workspace_bytes": (_rss() - rss0) / n,
                    "distinct_bytes": u.total_bytes, "failures": f1 + f2})
            t = time.perf_counter()
            for k in kids:
                k.close()
            points[-1]["close_ms_per_child"] = (time.perf_counter() - t) * 1e3 / len(kids)
            kids = []
            points[-1]["forks_from_threads"] = forks_from_threads(tpl, THREADS, 4 if len(ns) < 3 else 16)
        finally:
            for k in kids:
                k.close()
            tpl.close()
    finally:
        ld.close()
    return points


def measure_independent(n: int, calls: int) -> dict:
    wss: list = []
    try:
        t = time.perf_counter()
        while len(wss) < n:
            wss.append(build_workspace(MIB))
        create_ms = (time.perf_counter() - t) * 1e3 / n
        threaded, f1 = calls_from_threads([w.ws for w in wss], calls)
        aio, f2 = calls_from_asyncio([w.ws for w in wss], calls)
        u = pids_usage({w.ws.id: w.ws.host_pids() for w in wss}, pss=False)
        return {"n": n, "create_ms_per_workspace": create_ms, "run_threads": threaded, "run_asyncio": aio,
                "distinct_bytes": u.total_bytes, "failures": f1 + f2}
    finally:
        for w in wss:
            w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100 and 300 children, 20 independent")
    args = ap.parse_args()
    ns, indep_n, calls = ([100, 300], 20, 600) if args.quick else ([100, 300, 1000], 100, 2000)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(HELD_FDS)]  # a busy trainer's own
    try:
        children = measure_children(ns, calls)
        independent = measure_independent(indep_n, calls)
    finally:
        for fd in held:
            os.close(fd)
    big = children[-1]
    res = {
        "quick": args.quick, "worker_mib": MIB, "ns": ns, "trainer_held_fds": HELD_FDS,
        "threads": THREADS, "asyncio_in_flight": IN_FLIGHT, "calls_per_point": calls,
        "memory": memory_facts(), "children": children, "independent": independent,
        "failures": (sum(p["failures"] for p in children) + independent["failures"]
                     + big["forks_from_threads"]["failures"]),
        "forks_from_threads": big["forks_from_threads"],
        f"run_p99_asyncio_n{big['n']}_ms": big["run_asyncio"]["p99_ms"],
        f"run_p99_threads_n{big['n']}_ms": big["run_threads"]["p99_ms"],
        "fds_per_workspace": big["fds_per_workspace"], "threads_per_workspace": big["threads_per_workspace"],
        f"distinct_bytes_per_child_n{big['n']}": big["distinct_bytes"] / big["n"],
        f"distinct_bytes_per_independent_n{indep_n}": independent["distinct_bytes"] / indep_n,
    }
    plot(res)
    emit("load", res)


def plot(res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = res["children"]
    ns = [p["n"] for p in pts]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for key, style, label in (("run_threads", "o-", f"{res['threads']} threads"),
                              ("run_asyncio", "s-", f"asyncio, {res['asyncio_in_flight']} in flight")):
        a.plot(ns, [p[key]["p50_ms"] for p in pts], style, label=f"p50, {label}")
        a.plot(ns, [p[key]["p99_ms"] for p in pts], style, alpha=0.5, label=f"p99, {label}")
    a.set_xlabel("live children of one template")
    a.set_ylabel("run('echo ok') latency under load (ms)")
    a.set_xscale("log")
    a.legend(fontsize=8)
    b.plot(ns, [p["distinct_bytes"] / p["n"] / _M for p in pts], "o-", label="children: MiB per child")
    b.axhline(res["independent"]["distinct_bytes"] / res["independent"]["n"] / _M, color="#d62728",
              ls="--", label=f"independent workspaces (n={res['independent']['n']}): MiB each")
    b.set_xlabel("live children of one template")
    b.set_ylabel("distinct physical memory per workspace (MiB)")
    b.set_xscale("log")
    b.legend(fontsize=8)
    fig.suptitle(f"bench/load.py: failures {res['failures']}; trainer holds {res['trainer_held_fds']} "
                 "descriptors of its own")
    fig.tight_layout()
    fig.savefig(png_path("load"), dpi=110)


if __name__ == "__main__":
    main()
