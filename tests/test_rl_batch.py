"""BatchEngine on real workspaces: tasks × groups under one concurrency limit, verifier rewards
in every trajectory (crashing and hanging verifiers recorded, not fatal), token ids, logprobs and
the messages sent kept from a real chat-completions server, trajectories streamed as they end."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from bunshin.cache import PrefixCache
from bunshin.rl import (BatchEngine, Final, History, OpenAIPolicy, PolicyError, ReplayPolicy, RolloutEngine,
                        RolloutError, Task, Trajectory, Verdict, Verifier)

from chat_server import ChatServer, completion_text, logprob_of, prompt_text, text_reply, tool_reply


def task(tid: str, verifier=None, setup=(), **kw) -> Task:
    """A task whose setup stamps its workspace with a random id (/repo/id): rollouts that read
    the same id started from the same set-up workspace."""
    return Task(tid, "write your number to out", workdir="/repo", max_steps=6, verifier=verifier,
                setup=("head -c8 /dev/urandom | od -An -tx1 | tr -d ' \\n' > /repo/id", *setup), **kw)


def numbered(n: int, *, think_s: float = 0.02, first: tuple[str, ...] = ()) -> ReplayPolicy:
    """Rollout i writes i to /repo/out, then reads its workspace's id."""
    return ReplayPolicy([[*first, f"echo {i} > out", "cat id"] for i in range(n)], think_s=think_s)


def by_group(result) -> dict[int, list[Trajectory]]:
    return {n: g.trajectories for n, g in enumerate(result.groups)}


@pytest.mark.slow
def test_a_batch_of_tasks_and_groups_gets_verifier_rewards(no_leaks, tmp_path):
    def doubled(ws, traj):  # a Python verifier: reads the workspace the rollout ended in
        return Verdict(2.0 * int(ws.read_file("/repo/out")), True, output="read")

    a = task("A", "cat out; test -s out")  # the number printed is the reward
    b = task("B", Verifier(doubled, timeout=20))
    slow = ("sleep 0.3; echo slow",)
    with PrefixCache(tmp_path / "c.lmdb", snapshot=0.0) as cache, \
            BatchEngine(numbered(3, first=slow), [a, b, a], 3, mode="bunshin", cache=cache,
                        max_concurrency=4) as eng:
        res = eng.run()
    assert not res.errors, res.errors
    assert [(g.task_id, len(g.trajectories)) for g in res.groups] == [("A", 3), ("B", 3), ("A", 3)]
    for n, trajs in by_group(res).items():
        assert [t.index for t in trajs] == [0, 1, 2] and {t.group for t in trajs} == {n}
        for t in trajs:
            assert isinstance(t.final, Final) and len(t.turns) == 3
            want = t.index * (2.0 if t.task_id == "B" else 1.0)
            assert t.verdict.passed and t.reward == want and t.verdict.error is None, t.verdict
            assert t.verdict.seconds > 0
    assert [t.verdict.output for t in by_group(res)[1]] == ["read"] * 3
    ids = {n: {t.turns[2].observation for t in trajs} for n, trajs in by_group(res).items()}
    # A's two groups started from one template; B from its own
    assert len(ids[0]) == 1 and ids[0] == ids[2] and ids[1] != ids[0]
    # the prefix cache is the batch's: of A's six rollouts, one ran the shared slow call
    first = [t.turns[0].source for n in (0, 2) for t in by_group(res)[n]]
    assert sorted(first) == ["cache"] * 5 + ["exec"], first
    assert res.max_in_flight == 4
    d = res.as_dict()
    assert d["rollouts"] == 9 and d["verifier_errors"] == 0 and d["reward_mean"] == pytest.approx((3 + 6 + 3) / 9)
    assert d["peak_bytes"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fresh", "criu", "fork"])
def test_every_mode_runs_a_batch(no_leaks, mode):
    from bunshin.criu_locate import find_criu

    if mode == "criu" and not (find_criu() and find_criu().usable):
        pytest.skip("no CRIU ≥ 4 on this machine: `bunshin criu provision`")
    a, b = task("A", "cat out"), task("B", "cat out")
    with BatchEngine(numbered(2), [a, b, a], 2, mode=mode, max_concurrency=3, sample_interval=None) as eng:
        res = eng.run()
    assert not res.errors, res.errors
    assert [[t.reward for t in g.trajectories] for g in res.groups] == [[0.0, 1.0]] * 3
    ids = [t.turns[1].observation for t in res.trajectories]
    # fresh mode sets every rollout's workspace up anew; the others share the task's set-up state
    assert len(set(ids)) == (6 if mode == "fresh" else 2), ids
    assert res.max_in_flight == 3


@pytest.mark.slow
def test_crashing_hanging_and_odd_verifiers_are_recorded_not_fatal(no_leaks):
    def crash(ws, traj):
        raise ValueError("the checker broke")

    def hang(ws, traj):
        time.sleep(3)  # abandoned at the timeout: its thread is a daemon
        return True

    async def ahang(ws, traj):
        await asyncio.sleep(100)

    tasks = [task("crash", crash), task("hang-cmd", Verifier("sleep 100", timeout=1.0, failure_reward=-1.0)),
             task("hang-py", Verifier(hang, timeout=0.5)), task("hang-async", Verifier(ahang, timeout=0.5)),
             task("odd", lambda ws, traj: "yes"), task("fails", "exit 3"), task("none")]
    t0 = time.monotonic()
    with BatchEngine(numbered(1), tasks, 1, mode="fork", sample_interval=None) as eng:
        res = eng.run()
    assert time.monotonic() - t0 < 30
    got = {g.task_id: g.trajectories[0] for g in res.groups}
    assert all(t.error is None and len(t.turns) == 2 for t in got.values())
    v = got["crash"].verdict
    assert (v.reward, v.passed, v.error) == (0.0, False, "ValueError: the checker broke")
    v = got["hang-cmd"].verdict
    assert (v.reward, v.passed) == (-1.0, False) and "timed out after 1 s" in v.error and 0.9 < v.seconds < 5
    for tid in ("hang-py", "hang-async"):
        v = got[tid].verdict
        assert not v.passed and "timed out after 0.5 s" in v.error and v.seconds < 3, (tid, v)
    assert "returned 'yes'" in got["odd"].verdict.error
    v = got["fails"].verdict
    assert (v.reward, v.passed, v.error) == (0.0, False, None)
    assert got["none"].verdict is None and got["none"].reward is None
    assert res.as_dict()["verifier_errors"] == 5


def test_a_single_group_gets_verdicts_too(no_leaks):
    with RolloutEngine(numbered(2), task("one", "cat out"), 2, mode="fork", sample_interval=None) as eng:
        g = eng.run()
    assert [t.reward for t in g.trajectories] == [0.0, 1.0]
    assert [t.verdict.passed for t in g.trajectories] == [True, True]
    assert g.as_dict()["reward_mean"] == 0.5


def test_a_verifier_on_a_fork_leaves_the_workspace_as_it_was(ws):
    from bunshin.rl.verify import averify, verify

    traj = Trajectory("t", 0, "fork", [], None, 0.0, 0.0)
    ws.write_file("/n", "7\n")
    v = asyncio.run(averify(Verifier("touch /marker; echo 0.5; cat /n", on_fork=True), ws, traj))
    assert (v.reward, v.passed, v.error) == (7.0, True, None)  # the last line printed
    assert "0.5" in v.output
    assert not ws.run("test -e /marker").ok
    v = asyncio.run(averify(Verifier("touch /marker; echo 0.5"), ws, traj))
    assert v.reward == 0.5 and ws.run("test -e /marker").ok
    assert asyncio.run(averify(Verifier("true"), None, traj)).error == "the rollout had no workspace to verify"
    # outside an engine (an environment scoring mid-episode): no trajectory
    v = verify(Verifier(lambda w, t: (3.5, t is None), on_fork=True), ws)
    assert (v.reward, v.passed) == (3.5, True)

    async def from_a_loop():  # a framework calling a sync step from its event loop's thread
        return verify(Verifier("cat /n"), ws)

    assert asyncio.run(from_a_loop()).reward == 7.0


@pytest.mark.slow
@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_token_ids_logprobs_and_the_messages_sent_are_in_the_trajectory(no_leaks, flavor):
    srv = ChatServer(flavor)

    def respond(body):  # one call, then the answer, whatever the rollout
        if any(m["role"] == "tool" for m in body["messages"]):
            return 200, text_reply("done"), 0.0
        return 200, tool_reply("bash", json.dumps({"command": "echo hi > out; cat out"})), 0.0

    srv.responder = respond
    pol = OpenAIPolicy(srv.url, "m", token_ids=True, logprobs=True, top_logprobs=2, backoff_s=0, seed=5)
    tasks = [task("T1", "grep -q hi out"), task("T2", "grep -q hi out")]
    try:
        with BatchEngine(pol, tasks, 2, mode="fork", max_concurrency=3, sample_interval=None) as eng:
            res = eng.run()
    finally:
        srv.close()
    assert not res.errors, res.errors
    sent = [r["body"] for r in srv.requests]
    assert len(sent) == 8
    assert sorted(b["seed"] for b in sent) == sorted([5, 5, 6, 6, 5 + 100_003, 5 + 100_003, 6 + 100_003,
                                                      6 + 100_003])
    assert all(b["logprobs"] is True and b["top_logprobs"] == 2 and b["return_token_ids"] is True for b in sent)
    for t in res.trajectories:
        assert t.verdict.passed and t.reward == 1.0
        assert len(t.completions) == 2 and t.turns[0].completion is t.completions[0]
        assert t.turns[0].observation == "hi\n" and t.final.text == "done"
        for c in t.completions:
            body = next(b for b in sent if b["messages"] == c.messages)  # exactly what was sent
            assert c.tools == body["tools"]
            assert c.prompt_token_ids == list(prompt_text(body).encode())
            text = completion_text({"content": c.content, "tool_calls": c.tool_calls})
            assert bytes(c.completion_token_ids).decode() == text
            assert c.logprobs == [logprob_of(i) for i in c.completion_token_ids]
            assert [len(top) for top in c.top_logprobs] == [2] * len(text)
            assert c.usage["total_tokens"] > 0
        first = t.completions[0]
        assert first.finish_reason == "tool_calls" and first.tool_calls[0]["function"]["name"] == "bash"
        assert [m["role"] for m in t.completions[1].messages] == ["system", "user", "assistant", "tool"]


def test_a_server_without_token_ids_is_an_error_not_a_silent_gap():
    srv = ChatServer("plain")
    srv.reply(text_reply("done"))
    srv.reply(text_reply("done"))
    try:
        hist = History(Task("t", "p"))
        with pytest.raises(PolicyError, match="no prompt_token_ids although asked"):
            asyncio.run(OpenAIPolicy(srv.url, "m", token_ids=True, backoff_s=0).act(hist))
        assert hist.completions == []
        pol = OpenAIPolicy(srv.url, "m", logprobs=True, backoff_s=0)
        assert asyncio.run(pol.act(hist)) == Final("done")
        (c,) = hist.completions
        assert c.logprobs == [logprob_of(b) for b in b"done"] and c.prompt_token_ids is None
        assert c.top_logprobs is None and c.tokens == list("done")
    finally:
        srv.close()
    with pytest.raises(RolloutError, match="top_logprobs needs logprobs"):
        OpenAIPolicy("http://x/v1", "m", top_logprobs=3)


class Counting(ReplayPolicy):
    """Counts the rollouts between their first step and their answer."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.now = self.most = 0

    async def act(self, h):
        if not h.turns:
            self.now += 1
            self.most = max(self.most, self.now)
        out = await super().act(h)
        if isinstance(out, Final):
            self.now -= 1
        return out


@pytest.mark.slow
def test_stream_yields_as_rollouts_end_within_the_concurrency_limit(no_leaks):
    pol = Counting([["echo 1 > out", "sleep 0.3"]], think_s=0.05)
    tasks = [task(f"S{k}", "test -s out") for k in range(3)]
    with BatchEngine(pol, tasks, 2, mode="fork", max_concurrency=2, sample_interval=None) as eng:
        seen = []
        for traj in eng.stream():
            seen.append((time.monotonic(), traj))
        res = eng.result
    assert pol.most == 2 and res.max_in_flight == 2
    assert len(seen) == 6 and {(t.group, t.index) for _, t in seen} == {(g, i) for g in range(3) for i in range(2)}
    assert all(t.reward == 1.0 for _, t in seen)
    last_end = max(t.end_s for _, t in seen)
    assert seen[0][0] < last_end - 0.3  # the first came while others still ran
    assert res.trajectories == sorted((t for _, t in seen), key=lambda t: (t.group, t.index))


@pytest.mark.slow
def test_leaving_a_stream_early_cancels_the_rest(no_leaks):
    pol = ReplayPolicy([["sleep 0.2"], ["sleep 30"]], think_s=0.02)
    t0 = time.monotonic()
    with BatchEngine(pol, [task("E")], 4, mode="fork", sample_interval=None) as eng:
        stream = eng.stream()
        first = next(stream)
        stream.close()
    assert first.index in (0, 2) and time.monotonic() - t0 < 20 and eng.result is None


@pytest.mark.slow
def test_leaving_a_stream_during_a_setup_lets_go_of_what_it_makes(no_leaks):
    quick, slow = task("quick", "true"), task("slow", "true", setup=("sleep 2",))
    with BatchEngine(numbered(1), [quick, slow], 1, mode="fork", sample_interval=None) as eng:
        stream = eng.stream()
        assert next(stream).task_id == "quick"
        stream.close()  # slow's setup is still running: its template is closed once made
    assert eng.result is None


@pytest.mark.slow
def test_astream_yields_early_and_leaving_it_cancels_the_rest(no_leaks):
    pol = Counting([["sleep 0.2"], ["sleep 30"]], think_s=0.02)  # odd rollouts would run long

    async def main():
        eng = BatchEngine(pol, [task("Q")], 4, mode="fork", sample_interval=None)
        got = []
        t0 = time.monotonic()
        agen = eng.astream()
        async for traj in agen:
            got.append(traj)
            if len(got) == 2:
                break
        await agen.aclose()
        return eng, got, time.monotonic() - t0

    eng, got, took = asyncio.run(main())
    assert sorted(t.index for t in got) == [0, 2] and took < 20
    assert eng.result is None  # the batch did not finish


@pytest.mark.slow
def test_a_failing_setup_fails_its_groups_only(no_leaks):
    bad = task("bad", "true", setup=("echo oops; exit 3",))
    good = task("good", "true")
    with BatchEngine(numbered(1), [bad, good, bad], 1, mode="fork", sample_interval=None) as eng:
        res = eng.run()
    assert [g.task_id for g in res.groups] == ["bad", "good", "bad"]
    for n in (0, 2):
        (t,) = res.groups[n].trajectories
        assert "setup failed" in t.error and "exit code 3" in t.error and t.turns == []
        assert t.verdict.error == "the rollout had no workspace to verify" and t.reward == 0.0
    (t,) = res.groups[1].trajectories
    assert t.error is None and t.reward == 1.0


@pytest.mark.parametrize("args, msg", [
    (([],), "non-empty sequence"),
    (([Task("a", "x"), Task("a", "y")],), "like an earlier, different task"),
    (([Task("a", "x")], 0), "group_size must be an int"),
    (([Task("a", "x")], 1, "docker"), "mode must be one of"),
])
def test_bad_batches_are_refused(args, msg):
    args = (*args, 2) if len(args) == 1 else args
    with pytest.raises(RolloutError, match=msg):
        BatchEngine(ReplayPolicy([[]]), *args)
    with pytest.raises(RolloutError, match="max_concurrency"):
        BatchEngine(ReplayPolicy([[]]), [Task("a", "x")], 1, max_concurrency=0)
    with pytest.raises(RolloutError, match="Verifier.timeout"):
        Task("a", "x", verifier=Verifier("true", timeout=0))
    with pytest.raises(RolloutError, match="bash command str or a callable"):
        Task("a", "x", verifier=3)


def test_a_task_takes_a_bare_check_as_its_verifier():
    assert Task("a", "x", verifier="true").verifier == Verifier("true")
    assert Task("a", "x").verifier is None
