"""bench/workloads: each workload builds, its setup works and becomes ready on a real workspace,
its members share a prefix and then diverge, and every step behaves as its trace expects."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.workloads import DEFAULT, WORKLOADS, Workload, verify  # noqa: E402
from bench.workloads.check import run_setup, structure_problems  # noqa: E402

from bunshin.cache.tools import BUILTIN_TOOLS, ToolContext, run_tool  # noqa: E402
from bunshin.cache.toolcall import ToolCall  # noqa: E402
from bunshin.rl import Task  # noqa: E402

NAMES = sorted(WORKLOADS)


def build(name: str, group: int, seed: int = 0, quick: bool = True) -> Workload:
    try:
        return WORKLOADS[name](group, seed=seed, quick=quick)
    except RuntimeError as e:  # the sdist/wheels are neither cached nor downloadable
        if "pip download" in str(e):
            pytest.skip(str(e))
        raise


def test_registry():
    assert DEFAULT == "repo" and DEFAULT in WORKLOADS
    assert set(NAMES) == {"repo", "terminal", "server"}


@pytest.mark.parametrize("quick", [True, False])
@pytest.mark.parametrize("name", NAMES)
def test_shape(name, quick):
    w = build(name, 5, seed=3, quick=quick)
    assert isinstance(w.task, Task) and w.task.setup and w.task.ready
    assert len(w.traces) == 5 and all(isinstance(c, ToolCall) for t in w.traces for c in t)
    assert all(c.name in w.task.tools for t in w.traces for c in t)
    assert structure_problems(w, 5) == []
    k = w.params["shared_prefix_steps"]
    assert k >= 3 and w.params["divergence_step"] == k
    assert len({tuple(t[k:]) for t in w.traces}) == 5, "every member has its own continuation"
    assert all(len(t) <= w.task.max_steps for t in w.traces)
    lo, hi = (4, 10) if quick else (8, 16)
    assert all(lo <= len(t) <= hi for t in w.traces), [len(t) for t in w.traces]
    for key in ("seed", "quick", "group_size", "source", "setup_steps", "shared_prefix_steps",
                "steps_per_trace", "members", "think_s"):
        assert key in w.params, key
    json.dumps(w.params)  # plain data, for the benchmark's JSON
    # deterministic from the seed; another seed gives another group
    again = build(name, 5, seed=3, quick=quick)
    assert again.traces == w.traces and again.task == w.task and again.expect == w.expect
    other = build(name, 5, seed=4, quick=quick)
    assert other.traces != w.traces


def test_group_larger_than_variants_cycles():
    w = build("server", 15)
    assert len(w.traces) == 15 and structure_problems(w, 15) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_traces_run_on_real_workspaces(name, no_leaks):
    w = build(name, 3)
    rep = verify(w)
    assert rep.ok, "\n".join(rep.failures)
    assert rep.steps == sum(len(t) for t in w.traces)
    assert len(rep.setup_s) == 3 and max(rep.setup_s) < 20, rep.setup_s


@pytest.mark.slow
def test_default_workload_forks(no_leaks):
    """What the benchmark's fork modes do: set up once, fork, run each member's own steps."""
    import bunshin

    w = build(DEFAULT, 2)
    k = w.params["shared_prefix_steps"]
    with bunshin.Workspace.create() as base:
        box: list = []
        ctx = ToolContext(base, lambda: box[0] if box else box.append(base.shell()) or box[0])
        run_setup(base, w, ctx)
        for call in w.traces[0][:k]:
            assert run_tool(BUILTIN_TOOLS, ctx, call).exit_code == 0
        tpl = base.snapshot()
        kids = tpl.fork(2)
        try:
            for i, kid in enumerate(kids):
                assert kid.run(w.task.ready).exit_code == 0, "the language server survived the fork"
                kbox: list = []
                kctx = ToolContext(kid, lambda kid=kid, kbox=kbox: kbox[0] if kbox else kbox.append(kid.shell()) or kbox[0])
                kctx.shell().run(f"cd {w.task.workdir}")
                for j, (call, want) in enumerate(zip(w.traces[i][k:], w.expect[i][k:])):
                    r = run_tool(BUILTIN_TOOLS, kctx, call)
                    assert want is None or r.exit_code == want, (i, j, call, r.stdout[-500:])
        finally:
            for kid in kids:
                kid.close()
            tpl.close()


@pytest.mark.slow
def test_verify_reports_a_step_that_misbehaves(no_leaks):
    w = build("server", 1)
    k = w.params["shared_prefix_steps"]
    w.expect[0][k] = 7  # no redis-cli call exits 7
    w.traces[0].append(ToolCall("bash", {"command": "redis-cli get meta:users | grep -q '^20000$'"}))
    w.expect[0].append(0)
    w.traces[0].append(ToolCall("bash", {"command": "false"}))
    w.expect[0].append(0)
    rep = verify(w)
    assert len(rep.failures) == 2, rep.failures
    assert f"trace 0 step {k} " in rep.failures[0] and "expected 7" in rep.failures[0]
    assert f"step {len(w.traces[0]) - 1} " in rep.failures[1]
