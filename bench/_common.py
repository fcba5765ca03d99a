"""What every bench script shares: machine facts, percentiles, the JSON last line, plots."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

OUT = Path(os.environ.get("BUNSHIN_BENCH_OUT", Path(__file__).resolve().parent / "out"))


def machine() -> dict:
    """Facts that make a figure comparable: kernel, cores, memory, Python, load."""
    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    cpu = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "mem_bytes": mem,
        "python": platform.python_version(),
        "loadavg": os.getloadavg(),
    }


def timeit(fn: Callable[[], object], n: int, warmup: int = 3) -> list[float]:
    """Wall-clock seconds of ``n`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def summary(xs: list[float]) -> dict:
    """p50/p95/mean in milliseconds."""
    xs = sorted(xs)
    p95 = xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]
    return {"n": len(xs), "p50_ms": statistics.median(xs) * 1e3, "p95_ms": p95 * 1e3,
            "mean_ms": statistics.fmean(xs) * 1e3}


def emit(name: str, result: dict) -> None:
    """Write ``result`` as OUT/name.json and print it as the last stdout line."""
    OUT.mkdir(parents=True, exist_ok=True)
    result = {"bench": name, **result, "machine": machine()}
    (OUT / f"{name}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result), flush=True)


def png_path(name: str) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    return OUT / f"{name}.png"


def memory_facts() -> dict:
    """Kernel memory settings that change fork and memory figures: THP, KSM, cgroup version."""

    def read(p: str) -> str | None:
        try:
            with open(p) as f:
                return f.read().strip()
        except OSError:
            return None

    dyn = None
    try:
        from bunshin.runtime import cgroup
        from bunshin.runtime.cgroup import dynmods

        cg = cgroup.backend().name
        dyn = dynmods.active()
    except Exception as e:  # noqa: BLE001 - a fact, not a requirement
        cg = f"unknown ({e})"
    return {"thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "ksm_run": read("/sys/kernel/mm/ksm/run"), "cgroup": cg, "cgroup_favordynmods": dyn}
