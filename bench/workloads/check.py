"""Run a workload's traces on real workspaces and report every step that misbehaved.

``python3 -m bench.workloads.check [NAME ...] [--quick] [--group N] [--seed S]`` (from the
repository root) prints one line per trace and exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

import bunshin
from bunshin.cache.tools import BUILTIN_TOOLS, ToolContext, run_tool

from ._base import Workload

__all__ = ["Report", "run_setup", "structure_problems", "verify"]


@dataclass
class Report:
    """What ``verify`` found: ``failures`` (human-readable, empty when all is well) and timings
    in seconds (``setup_s`` per workspace, ``ready_s`` the wait for ``ready`` after setup,
    ``trace_s`` per trace)."""

    workload: str
    failures: list[str] = field(default_factory=list)
    setup_s: list[float] = field(default_factory=list)
    ready_s: list[float] = field(default_factory=list)
    trace_s: list[float] = field(default_factory=list)
    steps: int = 0

    @property
    def ok(self) -> bool:
        return not self.failures


def structure_problems(w: Workload, group_size: int | None = None) -> list[str]:
    """Checks that need no workspace: sizes, the shared prefix, divergence, expectations."""
    out = []
    n = len(w.traces)
    if group_size is not None and n != group_size:
        out.append(f"{n} traces for a group of {group_size}")
    if len(w.expect) != n or any(len(e) != len(t) for e, t in zip(w.expect, w.traces)):
        out.append("expect does not match the traces' shapes")
    k = w.shared_prefix
    for i, t in enumerate(w.traces):
        if len(t) <= k:
            out.append(f"trace {i} has {len(t)} steps, not more than the shared prefix ({k})")
        if t[:k] != w.traces[0][:k]:
            out.append(f"trace {i} does not share the first {k} steps")
    if n > 1:
        if len({tuple(t[k:k + 1]) for t in w.traces}) < 2 and len({tuple(t) for t in w.traces}) < n:
            out.append("members do not diverge after the shared prefix")
        if len({tuple(t) for t in w.traces}) < min(n, 2):
            out.append("all traces are identical")
    return out


def _ctx(ws: bunshin.Workspace) -> ToolContext:
    box: list = []

    def shell():
        if not box:
            box.append(ws.shell())
        return box[0]

    return ToolContext(ws, shell)


def run_setup(ws: bunshin.Workspace, w: Workload, ctx: ToolContext | None = None,
              ready_timeout: float = 120.0) -> tuple[float, float]:
    """Run the task's setup calls then poll ``ready``; (setup seconds, ready-wait seconds).
    Raises RuntimeError naming the step that failed."""
    ctx = ctx or _ctx(ws)
    t0 = time.monotonic()
    for j, call in enumerate(w.task.setup):
        r = run_tool(BUILTIN_TOOLS, ctx, call)
        if r.exit_code != 0:
            out = (r.stdout + r.stderr).decode(errors="replace")[-800:]
            raise RuntimeError(f"setup step {j} ({call.name}) exited {r.exit_code}: {out}")
    t1 = time.monotonic()
    if w.task.ready:
        end = t1 + ready_timeout
        while True:
            r = ws.run(w.task.ready, timeout=30)
            if r.exit_code == 0:
                break
            if time.monotonic() > end:
                raise RuntimeError(f"ready ({w.task.ready!r}) still failing after {ready_timeout} s: "
                                   f"{(r.stdout + r.stderr).decode(errors='replace')[-400:]}")
            time.sleep(0.05)
    return t1 - t0, time.monotonic() - t1


def verify(w: Workload, *, members: list[int] | None = None, verbose: int = 0) -> Report:
    """Run each trace (or those in ``members``) once, from setup, on its own real workspace
    (the task's rootfs and memory limit), checking every step against ``w.expect``."""
    rep = Report(w.params.get("workload", w.task.id))
    rep.failures += structure_problems(w)
    for i in (range(len(w.traces)) if members is None else members):
        kw = {"rootfs": w.task.rootfs}
        if w.task.memory_limit:
            kw["memory_limit"] = w.task.memory_limit
        with bunshin.Workspace.create(**kw) as ws:
            ctx = _ctx(ws)
            try:
                s, r = run_setup(ws, w, ctx)
            except RuntimeError as e:
                rep.failures.append(f"trace {i}: {e}")
                continue
            rep.setup_s.append(s)
            rep.ready_s.append(r)
            sh = ctx.shell()
            sh.run(f"cd {w.task.workdir}")
            t0 = time.monotonic()
            for j, (call, want) in enumerate(zip(w.traces[i], w.expect[i])):
                try:
                    res = run_tool(BUILTIN_TOOLS, ctx, call)
                    code, out = res.exit_code, (res.stdout + res.stderr).decode(errors="replace")
                    if res.timed_out:
                        code = "timeout"
                except bunshin.BunshinError as e:
                    code, out = f"raised {type(e).__name__}", str(e)
                rep.steps += 1
                if verbose:
                    print(f"  [{i}.{j}] {call.name} {str(dict(call.args))[:90]!s} -> {code}", file=sys.stderr)
                    if verbose > 1:
                        print("      " + out[-700:].replace("\n", "\n      "), file=sys.stderr)
                if want is not None and code != want:
                    rep.failures.append(f"trace {i} step {j} ({call.name} {str(dict(call.args))[:160]}): "
                                        f"exit {code}, expected {want}: {out[-600:]}")
            rep.trace_s.append(time.monotonic() - t0)
    return rep


def main(argv: list[str] | None = None) -> int:
    from . import WORKLOADS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", default=sorted(WORKLOADS))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-v", "--verbose", action="count", default=0)
    a = ap.parse_args(argv)
    bad = 0
    for name in a.names:
        t = time.monotonic()
        w = WORKLOADS[name](a.group, seed=a.seed, quick=a.quick)
        rep = verify(w, verbose=a.verbose)
        print(f"{name}: {'ok' if rep.ok else 'FAILED'} ({rep.steps} steps, setup "
              f"{', '.join(f'{x:.2f}' for x in rep.setup_s)} s, ready "
              f"{', '.join(f'{x:.2f}' for x in rep.ready_s)} s, traces "
              f"{', '.join(f'{x:.2f}' for x in rep.trace_s)} s, total {time.monotonic() - t:.1f} s)")
        for f in rep.failures:
            print("   ", f)
        bad += not rep.ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
