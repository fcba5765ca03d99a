"""Where the time of one ``ws.fork(1)`` / ``ws.snapshot()`` goes: a per-phase timeline.

The engine's steps are wrapped (at run time, in this process only) with perf_counter spans
that note their thread; each call of the path users call is repeated, and each phase's start
(from the call's start) and length are given as medians over the repetitions, with the fork
thread's and the other threads' CPU time per call (/proc/self/task/*/schedstat).

usage: python bench/fork_phases.py [--sizes small,medium] [-n 50] [--what fork,snapshot]
(last stdout line: JSON; the tables go to stderr)
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402
from _workloads import build_workspace  # noqa: E402

from bunshin.fork import earlyinit, engine, keeper, seize, slots, template  # noqa: E402
from bunshin.fork import tree  # noqa: E402
from bunshin.fork.resources import threads as res_threads  # noqa: E402
from bunshin.runtime import layers  # noqa: E402
from bunshin.runtime.body import Body  # noqa: E402
from bunshin.runtime.cgroup.v1 import V1Cgroup  # noqa: E402
from bunshin.runtime.channel import Channel  # noqa: E402
from bunshin.runtime.workspace import Workspace  # noqa: E402

_events: list[tuple[str, str, float, float]] = []  # (phase, thread, start, end)
_on = False


def _wrap(owner, attr: str, name: str | None = None) -> None:
    fn = getattr(owner, attr)
    label = name or f"{getattr(owner, '__name__', owner)}.{attr}"

    @functools.wraps(fn)
    def timed(*a, **kw):
        if not _on:
            return fn(*a, **kw)
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            _events.append((label, threading.current_thread().name, t, time.perf_counter()))

    setattr(owner, attr, timed)


def _wrap_make() -> None:
    """The upper layer's snapshot itself (what layers.prepare_freeze returns)."""
    prep = layers.prepare_freeze

    def prepare(*a, **kw):
        make = prep(*a, **kw)

        def timed_make():
            t = time.perf_counter()
            try:
                return make()
            finally:
                if _on:
                    _events.append(("layers.snapshot", threading.current_thread().name, t, time.perf_counter()))
        return timed_make

    template.layers.prepare_freeze = prepare  # type: ignore[attr-defined]


PHASES = [
    (keeper.ForkThread, "run", "handoff: caller waits"),
    (keeper.ForkThread, "_finish", "handoff: fork thread runs"),
    (Workspace, "_fork", "ws._fork"),
    (V1Cgroup, "freeze", "cgroup.freeze"),
    (V1Cgroup, "thaw", "cgroup.thaw"),
    (template, "_start_copy", None),
    (template, "_copy_upper", None),
    (engine, "overlay_fd", None),
    (template, "_plan_and_seize", None),
    (template, "plan_tree", None),
    (template, "_plan_settled", None),
    (template, "sysv_objects", None),
    (seize, "seize_all", None),
    (seize.Pinned, "__init__", "seize.Pinned"),
    (template, "_init_beside_copy", None),
    (engine, "clone_init_unrooted", None),
    (engine, "reroot", None),
    (earlyinit, "pidfd_of", None),
    (earlyinit, "start", None),
    (template.TemplateCore, "__init__", "TemplateCore()"),
    (template.TemplateCore, "_fork", "core._fork"),
    (template.TemplateCore, "_fork_many", "core._fork_many"),
    (template._Child, "__init__", "_Child()"),
    (template._Child, "settle", "_Child.settle"),
    (template._Child, "ready", "_Child.ready"),
    (template._Child, "ask", "_Child.ask"),
    (template._Child, "finish", "_Child.finish"),
    (template._Child, "hand_out", "_Child.hand_out"),
    (Channel, "wait_ready", "Channel.wait_ready"),
    (engine, "fix_process", None),
    (engine, "finish_child", None),
    (template.TemplateCore, "_let_go_locked", "core.let_go"),
    (res_threads, "count_down_source", None),
    (seize, "release_all", None),
    (template.TemplateCore, "close_slots", "core.close_slots"),
    (template.TemplateCore, "release", "core.release"),
    (slots, "request", "slots.request"),
    (template, "snapshot_body", None),
    (template.TemplateCore, "plan_idle", "core.plan_idle"),
    (Body, "open_root", "Body.open_root"),
    (Workspace, "from_body", "Workspace.from_body"),
]


_fork_thread_rusage = [0.0, 0.0]  # user, system seconds of the fork thread in calls timed


def _count_fork_thread_rusage() -> None:
    """The fork thread's user and system time in its calls (the kernel's share of its work)."""
    fin = keeper.ForkThread._finish

    def timed(self, call):
        if not _on:
            return fin(self, call)
        r0 = resource.getrusage(resource.RUSAGE_THREAD)
        try:
            return fin(self, call)
        finally:
            r1 = resource.getrusage(resource.RUSAGE_THREAD)
            _fork_thread_rusage[0] += r1.ru_utime - r0.ru_utime
            _fork_thread_rusage[1] += r1.ru_stime - r0.ru_stime

    keeper.ForkThread._finish = timed


def _instrument() -> None:
    for owner, attr, name in PHASES:
        if hasattr(owner, attr):  # an older engine may not have it (before/after runs)
            _wrap(owner, attr, name)
    _count_fork_thread_rusage()
    mk = tree.maker
    # the tree maker's per-child work (clones and fixups without the kernel module)

    def maker(*a, **kw):
        m = mk(*a, **kw)
        _wrap(m, "child", "tree.child")
        return m

    template.tree.maker = maker  # type: ignore[attr-defined]
    _wrap_make()


def _cpu_by_thread() -> dict[str, float]:
    """Seconds of CPU per thread name of this process."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        comm = names.get(int(tid), "other")
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except OSError:
            continue
        out[comm] = out.get(comm, 0.0) + ns / 1e9
    return out


def _one(call) -> tuple[list, dict[str, float], float]:
    global _on
    cpu0 = _cpu_by_thread()
    _events.clear()
    _on = True
    t0 = time.perf_counter()
    kids = call()
    dt = time.perf_counter() - t0
    _on = False
    cpu1 = _cpu_by_thread()
    evs = [(n, th, s - t0, e - s) for n, th, s, e in _events]
    for k in kids:
        k.close()
    return evs, {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items()}, dt


def measure(ld, what: str, n: int) -> dict:
    call = (lambda: ld.ws.fork(1)) if what == "fork" else (lambda: [ld.ws.snapshot()])
    for _ in range(3):
        _one(call)
    _fork_thread_rusage[:] = [0.0, 0.0]
    self0 = resource.getrusage(resource.RUSAGE_SELF)
    runs = []
    for _ in range(n):
        runs.append(_one(call))
        time.sleep(0.01)  # the made-ahead work of the next call (slots.py) has time to run
    by: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for evs, _cpu, _dt in runs:
        seen: dict[tuple[str, str], tuple[float, float]] = {}
        for name, th, s, d in evs:
            key = (name, "fork" if th == "bunshin-fork" else "caller" if th == "MainThread" else th)
            if key in seen:  # several calls in one fork: first start, total length
                s0, d0 = seen[key]
                seen[key] = (s0, d0 + d)
            else:
                seen[key] = (s, d)
        for key, v in seen.items():
            by.setdefault(key, []).append(v)
    rows = []
    for (name, th), vs in by.items():
        rows.append({"phase": name, "thread": th, "n": len(vs),
                     "start_ms": statistics.median(v[0] for v in vs) * 1e3,
                     "ms": statistics.median(v[1] for v in vs) * 1e3})
    rows.sort(key=lambda r: r["start_ms"])
    cpu: dict[str, list[float]] = {}
    for _evs, c, _dt in runs:
        for k, v in c.items():
            cpu.setdefault(k, []).append(v)
    self1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"p50_ms": statistics.median(r[2] for r in runs) * 1e3,
            "fork_thread_user_ms_per_call": _fork_thread_rusage[0] / n * 1e3,
            "fork_thread_system_ms_per_call": _fork_thread_rusage[1] / n * 1e3,
            "trainer_user_ms_per_call": (self1.ru_utime - self0.ru_utime) / n * 1e3,
            "trainer_system_ms_per_call": (self1.ru_stime - self0.ru_stime) / n * 1e3,
            "phases": rows,
            "cpu_ms_per_call": {k: statistics.median(v) * 1e3 for k, v in cpu.items()
                                if statistics.median(v) > 1e-5}}


def _print(title: str, res: dict) -> None:
    print(f"\n== {title}: p50 {res['p50_ms']:.2f} ms", file=sys.stderr)
    print(f"{'start':>7} {'ms':>7}  {'thread':<20} phase", file=sys.stderr)
    for r in res["phases"]:
        print(f"{r['start_ms']:7.3f} {r['ms']:7.3f}  {r['thread']:<20} {r['phase']}"
              + ("" if r["n"] == res.get("_n") else f"  (in {r['n']})"), file=sys.stderr)
    print(f"fork thread user {res['fork_thread_user_ms_per_call']:.2f} ms system "
          f"{res['fork_thread_system_ms_per_call']:.2f} ms per call; trainer process user "
          f"{res['trainer_user_ms_per_call']:.2f} system {res['trainer_system_ms_per_call']:.2f} "
          "(sleep and close between calls included)", file=sys.stderr)
    print("CPU ms per call: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(res["cpu_ms_per_call"].items())),
          file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="small,medium")
    ap.add_argument("-n", type=int, default=50)
    ap.add_argument("--what", default="fork,snapshot")
    ap.add_argument("--bare", action="store_true", help="no spans: the calls' own time only")
    args = ap.parse_args()
    if not args.bare:
        _instrument()
    sizes = {"small": 0, "medium": 256}
    out: dict = {"n": args.n, "loadavg_before": os.getloadavg(), "sizes": {}}
    for name in args.sizes.split(","):
        ld = build_workspace(sizes[name])
        try:
            out["sizes"][name] = {}
            for what in args.what.split(","):
                res = measure(ld, what, args.n)
                res["_n"] = args.n
                _print(f"{name} ws.{what}", res)
                del res["_n"]
                out["sizes"][name][what] = res
        finally:
            ld.close()
    out["loadavg_after"] = os.getloadavg()
    emit("fork_phases", out)


if __name__ == "__main__":
    main()
