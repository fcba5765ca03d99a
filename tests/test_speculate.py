"""Speculation: ``ws.speculate()`` blocks and the ``SpeculativeExecutor`` (issue 5), on real
workspaces with real commands."""

from __future__ import annotations

import time

import pytest

import bunshin
from bunshin.cache import PrefixCache, ToolCall
from bunshin.runtime.workspace import _live
from bunshin.speculate import SpeculationError
from bunshin.speculate.predict import TriePredictor


@pytest.fixture
def ws():
    w = bunshin.Workspace.create()
    sh = w.shell()
    sh.run("X=before; mkdir -p /work && echo v0 > /work/f")
    yield w
    w.close()


def _sleepers(w) -> list:
    return [p for p in w.processes() if p.cmdline[:2] == ["sleep", "4242"]]


def _depth(w) -> int:
    with open(f"/proc/{w.init_pid}/status") as f:
        return next(len(l.split()) - 1 for l in f if l.startswith("NSpid:"))


def _live_forks(base) -> set:
    return {w for w in _live if w is not base}


def test_commit_keeps_files_and_shell_state(ws):
    sh = ws.shells[0]
    with ws.speculate() as spec:
        r = spec.shell().run("X=after; echo v1 > /work/f; cd /work")
        assert r.exit_code == 0
        assert ws.read_file("/work/f") == b"v0\n"  # ws untouched during the block
    assert spec.outcome == "committed"
    assert ws.read_file("/work/f") == b"v1\n"
    assert sh.run("echo $X; pwd").stdout.split() == [b"after", b"/work"]  # the user's Shell object
    assert not _live_forks(ws)


def test_rollback_restores_files_processes_shell(ws):
    sh = ws.shells[0]
    with ws.speculate() as spec:
        spec.shell().run("X=after; echo v1 > /work/f; rm -f /work/f; touch /work/new")
        spec.ws.spawn(["sleep", "4242"])
        assert _sleepers(spec.ws)
        ws.run("echo direct > /work/g")  # ws's own call, not the block's: it stays
        spec.rollback()
        raise AssertionError("rollback() must leave the block")
    assert spec.outcome == "rolled back"
    assert ws.read_file("/work/f") == b"v0\n"
    assert ws.run("ls /work").stdout == b"f\ng\n"
    assert not _sleepers(ws)
    assert sh.run("echo $X").stdout == b"before\n"
    assert not _live_forks(ws)


def test_exception_rolls_back_and_propagates(ws):
    with pytest.raises(KeyError, match="boom"), ws.speculate() as spec:
        spec.shell().run("X=after; echo v1 > /work/f")
        spec.ws.spawn(["sleep", "4242"])
        raise KeyError("boom")
    assert ws.read_file("/work/f") == b"v0\n"
    assert not _sleepers(ws)
    assert ws.shells[0].run("echo $X").stdout == b"before\n"
    assert not _live_forks(ws)


def test_rollback_loop_does_not_deepen(ws):
    depths, tasks = set(), set()
    for i in range(12):
        with ws.speculate() as spec:
            depths.add(_depth(ws))
            tasks.add(tuple(ws.host_pids()))
            spec.shell().run(f"X={i}; echo {i} >> /work/f")
            spec.rollback()
    assert len(depths) == 1 and len(tasks) == 1  # ws never left its own processes
    assert ws.read_file("/work/f") == b"v0\n"
    assert ws.shells[0].run("echo $X").stdout == b"before\n"


def test_commit_loop_and_nesting(ws):
    for i in range(10):
        with ws.speculate() as spec:
            spec.shell().run("X=${X}+; echo $X >> /work/f")
    lines = ws.read_file("/work/f").splitlines()
    assert len(lines) == 11 and lines[-1] == b"before" + b"+" * 10
    with ws.speculate() as outer:
        outer.shell().run("Y=outer")
        with outer.ws.speculate() as inner:
            inner.shell().run("Z=inner")
        assert outer.shell().run("echo $Y$Z").stdout == b"outerinner\n"
        outer.rollback()
    assert ws.shells[0].run("echo [$Y$Z]").stdout == b"[]\n"


def test_misuse_is_reported(ws):
    with pytest.raises(SpeculationError, match="Workspace"):
        bunshin.speculate.Speculation("not a workspace")  # type: ignore[arg-type]
    spec = ws.speculate()
    with spec:
        pass
    with pytest.raises(SpeculationError, match="inside the speculation block"):
        spec.rollback()
    with pytest.raises(SpeculationError, match="entered once"), spec:
        pass
    with pytest.raises(SpeculationError, match="max_inflight"):
        bunshin.SpeculativeExecutor(lambda h: [], max_inflight=0)
    with pytest.raises(SpeculationError, match="predictor"):
        bunshin.SpeculativeExecutor(None)  # type: ignore[arg-type]


# -- executor -----------------------------------------------------------------------------
COUNTED = "echo run >> /work/count; X=spec; echo done"


def test_executor_hit_runs_once_and_equals_fresh(ws):
    fresh = ws.fork(1)[0]
    try:
        want = fresh.shells[0].run(COUNTED)
        want_state = fresh.shells[0].run("echo $X; cat /work/count").stdout
    finally:
        fresh.close()
    ex = bunshin.SpeculativeExecutor(lambda h: ["echo other > /work/o", COUNTED], max_inflight=2)
    assert ex.prefetch(ws, []) == [ToolCall("bash", {"command": "echo other > /work/o"}),
                                   ToolCall("bash", {"command": COUNTED})]
    r = ex.call(ws, COUNTED)
    assert (r.stdout, r.exit_code) == (want.stdout, want.exit_code)
    assert ws.shells[0].run("echo $X; cat /work/count").stdout == want_state == b"spec\nrun\n"
    assert ws.run("ls /work").stdout == b"count\nf\n"  # the other branch left nothing
    st = ex.stats
    assert (st.hits, st.misses, st.speculated) == (1, 0, 2)
    assert st.saved_seconds >= 0 and st.wasted_cpu_seconds > 0
    assert not _live_forks(ws)


def test_executor_miss_discards_forks(ws):
    ex = bunshin.SpeculativeExecutor(lambda h: ["echo wrong > /work/w; X=wrong; sleep 4242 &"])
    assert len(ex.prefetch(ws, [])) == 1
    r = ex.call(ws, COUNTED)
    assert r.stdout.strip() == b"done"
    assert ws.read_file("/work/count") == b"run\n"
    assert ws.run("ls /work").stdout == b"count\nf\n"
    assert not _sleepers(ws)
    assert ex.stats.misses == 1 and ex.stats.hits == 0
    assert not _live_forks(ws)


def test_executor_miss_kills_running_branch(ws):
    ex = bunshin.SpeculativeExecutor(lambda h: ["sleep 30; echo late > /work/late"])
    ex.prefetch(ws, [])
    t0 = time.monotonic()
    assert ex.call(ws, "echo hi").stdout == b"hi\n"
    assert time.monotonic() - t0 < 5  # the branch was killed, not waited for
    assert ws.run("ls /work").stdout == b"f\n"
    assert not _live_forks(ws)


def test_executor_never_speculates_uncacheable(ws):
    ex = bunshin.SpeculativeExecutor(lambda h: ["curl http://x", "date"],
                                     cacheable=lambda c: "curl" not in c.args["command"])
    assert ex.prefetch(ws, []) == [ToolCall("bash", {"command": "date"})]
    assert ex.stats.skipped == 1
    ex.close()
    assert not _live_forks(ws)
    ex2 = bunshin.SpeculativeExecutor(lambda h: ["curl http://x"], cacheable=lambda c: False)
    assert ex2.prefetch(ws, []) == [] and ex2.stats.speculated == 0
    assert not _live_forks(ws)


def test_executor_with_cache_session_and_trie_predictor(ws, tmp_path):
    with PrefixCache(tmp_path / "c.lmdb", snapshot=1e9) as cache:  # snapshot=huge: keep no states
        a = ws.fork(2)
        try:
            s1 = cache.rollout(a[0], "t")
            s1.call("echo hi > /work/h")
            s1.call(COUNTED)
            ex = bunshin.SpeculativeExecutor(TriePredictor(cache, "t"), max_inflight=1)
            s2 = cache.rollout(a[1], "t")
            s2.call("echo hi > /work/h")
            assert ex.prefetch(s2, ["echo hi > /work/h"]) == [ToolCall("bash", {"command": COUNTED})]
            r = ex.call(s2, COUNTED)
            assert r.stdout == b"done\n" and ex.stats.hits == 1
            assert a[1].read_file("/work/count") == b"run\n"
            assert s2.shell.run("echo $X").stdout == b"spec\n"
            assert s2.key is not None and cache.store.get(s2.key)["visits"] == 2
        finally:
            for w in a:
                w.close()
    assert not _live_forks(ws)
