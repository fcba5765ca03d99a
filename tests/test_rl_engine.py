"""RolloutEngine on real workspaces: every mode gives the same trajectories, the cache answers
shared prefixes once, rollouts stay isolated, the sampler sees real memory, failures are
contained and reported."""

from __future__ import annotations

import pytest

from bunshin.cache.toolcall import ToolCall
from bunshin.criu_locate import find_criu
from bunshin.rl import Final, RolloutError, Task
from bunshin.rl.engine import MODES, RolloutEngine
from bunshin.rl.policies import ReplayPolicy

HOG_MIB = 48
HOG = (f"import time\nb = bytearray({HOG_MIB} << 20)\nb[::4096] = b'x' * (len(b) // 4096)\n"
       "open('/tmp/hog-ready', 'w').close()\ntime.sleep(1e6)\n")
TASK = Task(
    "engine-test", "make b.txt hold your number",
    setup=(ToolCall("write_file", {"path": "/repo/a.txt", "content": "alpha\n"}),
           ToolCall("write_file", {"path": "/repo/hog.py", "content": HOG}),
           ToolCall("bash", {"command": "export STAGE=set-up; (python3 /repo/hog.py &)"})),
    ready="test -e /tmp/hog-ready", workdir="/repo", max_steps=8)
SHARED = ["cat a.txt", "echo $STAGE", "sleep 0.2; echo slow"]


def traces(n: int) -> list[list[str]]:
    return [SHARED + [f"echo {i} > b.txt", "cat b.txt", "ls"] for i in range(n)]


def scripted(traces: list[list[str]]) -> ReplayPolicy:
    """Rollout i replays ``traces[i]`` (bash commands), 50 ms of thinking per step."""
    return ReplayPolicy(traces, think_s=0.05)


def observations(g):
    return [[(t.call.args["command"], t.observation, t.exit_code) for t in tr.turns] for tr in g.trajectories]


def run(mode: str, n: int = 3, **kw):
    with RolloutEngine(scripted(traces(n)), TASK, n, mode=mode, **kw) as eng:
        return eng.run()


def expected(n: int):
    out = []
    for i in range(n):
        out.append([("cat a.txt", "alpha\n", 0), ("echo $STAGE", "set-up\n", 0), ("sleep 0.2; echo slow", "slow\n", 0),
                    (f"echo {i} > b.txt", "", 0), ("cat b.txt", f"{i}\n", 0), ("ls", "a.txt  b.txt  hog.py\n", 0)])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_gives_the_same_trajectories(no_leaks, mode):
    if mode == "criu" and not (find_criu() and find_criu().usable):
        pytest.skip("no CRIU ≥ 4 on this machine: `bunshin criu provision`")
    g = run(mode)
    assert not g.errors
    assert observations(g) == expected(3)
    assert all(isinstance(t.final, Final) for t in g.trajectories)
    assert g.latency_s >= max(t.latency_s for t in g.trajectories)
    assert g.setup_s > 0
    d = g.as_dict()
    assert d["turns"] == 18 and d["mode"] == mode


@pytest.mark.slow
def test_bunshin_mode_answers_the_shared_prefix_from_the_cache(no_leaks, tmp_path):
    from bunshin.cache import PrefixCache

    with PrefixCache(tmp_path / "c.lmdb", snapshot=0.0) as cache:  # every state kept
        g = run("bunshin", 3, cache=cache)
    assert observations(g) == expected(3)
    # three rollouts × three shared calls: each executed once, the other two answered from the cache
    assert g.cache["misses"] == 3 + 3 * 3 and g.cache["hits"] == 6, (g.cache, observations(g))
    assert g.cache["snapshots"] == 12 and g.cache["snapshot_seconds"] > 0
    assert g.as_dict()["sources"] == {"exec": 12, "cache": 6}
    for tr in g.trajectories:
        assert [t.source for t in tr.turns][3:] == ["exec"] * 3


@pytest.mark.slow
def test_the_private_cache_keeps_only_states_worth_a_snapshot(no_leaks):
    """Quick calls are cheaper to re-run than to snapshot: only the 0.2 s call is kept."""
    g = run("bunshin", 3)
    assert observations(g) == expected(3)
    assert g.cache["snapshots"] == 1 and g.cache["hits"] == 2, g.cache


@pytest.mark.slow
def test_memory_sampler_sees_the_copies_and_the_sharing(no_leaks):
    fresh, fork = run("fresh", 3), run("fork", 3)
    hog = HOG_MIB << 20
    # fresh: three hogs alive at once; fork: one hog's pages shared by the template and 3 forks
    assert fresh.memory.peak_bytes > 3 * hog
    assert fork.memory.peak_bytes < 1.8 * hog
    assert fork.memory.gb_s < fresh.memory.gb_s
    assert len(fresh.memory.times) >= 3


@pytest.mark.slow
def test_a_failing_rollout_does_not_end_the_group(no_leaks):
    class Bad(ReplayPolicy):
        async def act(self, h):
            if h.index == 1 and len(h.turns) == 1:
                return ToolCall("no_such_tool", {})
            return await super().act(h)

    with RolloutEngine(Bad(traces(2), think_s=0.05), TASK, 2, mode="fork") as eng:
        g = eng.run()
    assert g.trajectories[0].error is None and len(g.trajectories[0].turns) == 6
    assert "no_such_tool" in g.trajectories[1].error and len(g.trajectories[1].turns) == 1
    assert g.errors == [f"rollout 1: {g.trajectories[1].error}"]


def test_a_failing_setup_says_which_step(no_leaks):
    bad = Task("bad-setup", "x", setup=("true", "echo oops; exit 3"))
    with RolloutEngine(scripted([[]]), bad, 1, mode="fork", sample_interval=None) as eng:
        with pytest.raises(RolloutError, match=r"setup step 1 .*exit code 3.*oops"):
            eng.run()


@pytest.mark.parametrize("kw, msg", [
    ({"mode": "docker"}, "mode must be one of"),
    ({"group_size": 0}, "group_size must be an int"),
    ({"concurrency": 0}, "concurrency must be an int"),
    ({"mode": "fresh", "cache": True}, "need forks"),
    ({"mode": "fork", "speculate": True, "cache": False}, "enable cache"),
])
def test_bad_arguments_are_refused(kw, msg):
    args = {"group_size": 2, **kw}
    with pytest.raises(RolloutError, match=msg):
        RolloutEngine(scripted([[]]), TASK, **args)


def test_bad_policy_and_task_are_refused():
    with pytest.raises(RolloutError, match="async act"):
        RolloutEngine(object(), TASK, 1)
    with pytest.raises(RolloutError, match="unknown tools"):
        RolloutEngine(scripted([[]]), Task("t", "p", tools=("bash", "browser")), 1)


def test_sampler_reuses_frozen_pfns_and_agrees_with_pids_usage(no_leaks, monkeypatch):
    import time

    # the next children's inits, made in the background after tpl.fork (fork/earlyinit.py),
    # would change the family between the two samples compared here
    monkeypatch.setenv("BUNSHIN_EARLY_INIT", "0")

    import bunshin
    from bunshin.memory import pids_usage
    from bunshin.rl.metrics import MemorySampler, cgroup_frozen, cgroup_pids
    from bunshin.runtime.cgroup._fs import wait_for

    ws = bunshin.Workspace.create()
    tpl = kids = None
    try:
        ws.write_file("/hog.py", HOG)
        ws.spawn(["python3", "/hog.py"])
        while not ws.run("test -e /tmp/hog-ready").ok:
            time.sleep(0.02)
        tpl = ws.snapshot()
        kids = tpl.fork(2)
        # the held template is refrozen once the fork engine is idle: sampled before, it is
        # running (ptrace-stopped), and its pages are not cached
        wait_for(cgroup_frozen, 5)
        s = MemorySampler()
        assert s.footprint() == pids_usage(cgroup_pids(), pss=False).total_bytes
        frozen = {p for name in cgroup_frozen() for p in cgroup_pids()[name]}
        assert frozen and set(s._cache) == frozen  # only the template's processes are cached
        # a child writes its copy of the hog: new private pages, seen although the template is cached
        before = s.footprint()
        kids[0].write_file("/dirty.py", "b = bytearray(32 << 20)\nb[::4096] = b'y' * (len(b) // 4096)\n"
                           "import time; open('/tmp/dirty', 'w').close(); time.sleep(1e6)\n")
        kids[0].spawn(["python3", "/dirty.py"])
        while not kids[0].run("test -e /tmp/dirty").ok:
            time.sleep(0.02)
        after = s.footprint()
        assert after - before >= 32 << 20
        assert after == pids_usage(cgroup_pids(), pss=False).total_bytes
    finally:
        for k in kids or []:
            k.close()
        if tpl is not None:
            tpl.close()
        ws.close()


@pytest.mark.slow
def test_speculation_runs_predicted_calls_while_the_policy_thinks(no_leaks):
    """An oracle predictor (what a draft model would be at best): every call after the first
    was already run on a fork when the policy asks for it; the outputs are the same."""
    tr = traces(2)

    def oracle(history):
        for t in tr:
            if [ToolCall("bash", {"command": c}) for c in t[: len(history)]] == list(history) and len(t) > len(history):
                return [ToolCall("bash", {"command": t[len(history)]})]
        return []

    # states are kept only after calls of 10 s or more: nothing is cached, speculation does it all
    g = run("bunshin", 2, snapshot_after=10.0, predictor=oracle)
    assert observations(g) == expected(2)
    assert g.cache["hits"] == 0
    assert g.speculation["hits"] >= 8, g.speculation
    assert g.as_dict()["sources"].get("speculation", 0) == g.speculation["hits"]


def test_a_predictor_must_be_callable():
    with pytest.raises(RolloutError, match="predictor must be callable"):
        RolloutEngine(scripted([[]]), TASK, 1, predictor="oracle")
