"""Policies: ReplayPolicy (determinism, exhaustion, validation, files) and OpenAIPolicy against
a real HTTP server speaking the chat-completions protocol (scripted replies, recorded requests)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from bunshin.cache.toolcall import ToolCall
from bunshin.rl import Final, History, Policy, PolicyError, RolloutError, Task, Turn
from bunshin.rl.policies import BUILTIN_TOOL_SCHEMAS, OpenAIPolicy, ReplayPolicy

from chat_server import ChatServer, text_reply, tool_reply

TASK = Task(id="t1", prompt="fix the bug")


def hist(index: int = 0, turns: int = 0, task: Task = TASK) -> History:
    return History(task, index, [Turn(ToolCall("bash", {"command": f"echo {i}"}), f"{i}\n", 0)
                                 for i in range(turns)])


def act(policy, history: History):
    return asyncio.run(policy.act(history))


# -- ReplayPolicy -------------------------------------------------------------------------

def test_replay_follows_the_trace_of_its_index_then_final():
    pol = ReplayPolicy([["ls", ToolCall("read_file", {"path": "/a"})], ["pwd"]])
    assert isinstance(pol, Policy)
    assert act(pol, hist(0, 0)) == ToolCall("bash", {"command": "ls"})
    assert act(pol, hist(0, 1)) == ToolCall("read_file", {"path": "/a"})
    assert act(pol, hist(0, 2)) == Final()
    assert act(pol, hist(0, 9)) == Final()
    assert act(pol, hist(1, 0)) == ToolCall("bash", {"command": "pwd"})
    assert act(pol, hist(1, 1)) == Final()
    assert act(pol, hist(2, 1)) == ToolCall("read_file", {"path": "/a"})  # 2 % 2 == 0
    assert ReplayPolicy([[]]).trace(5) == ()


def test_replay_think_time_is_deterministic_and_bounded():
    a = ReplayPolicy([["ls"]], think_s=1.0, jitter=0.5, seed=7)
    b = ReplayPolicy([["ls"]], think_s=1.0, jitter=0.5, seed=7)
    times = [a.think_time("t1", i, s) for i in range(8) for s in range(8)]
    assert times == [b.think_time("t1", i, s) for i in range(8) for s in range(8)]
    assert all(0.5 <= t <= 1.5 for t in times)
    assert len(set(times)) == len(times)  # every (index, step) draws its own
    assert max(times) - min(times) > 0.5  # and they spread over the range
    c = ReplayPolicy([["ls"]], think_s=1.0, jitter=0.5, seed=8)
    assert c.think_time("t1", 0, 0) != a.think_time("t1", 0, 0)
    assert a.think_time("t2", 0, 0) != a.think_time("t1", 0, 0)
    assert ReplayPolicy([["ls"]], think_s=0.25).think_time("t1", 3, 4) == 0.25  # no jitter
    f = ReplayPolicy([["ls"]], think_s=lambda step: 2.0 if step == 0 else 0.5)
    assert (f.think_time("t", 0, 0), f.think_time("t", 0, 1)) == (2.0, 0.5)


def test_replay_sleeps_its_think_time_concurrently():
    pol = ReplayPolicy([["ls"]], think_s=0.2, jitter=0.5, seed=1)
    expect = [pol.think_time("t1", i, 0) for i in range(4)]

    async def one(i):
        t0 = time.monotonic()
        await pol.act(hist(i, 0))
        return time.monotonic() - t0

    async def group():
        t0 = time.monotonic()
        took = await asyncio.gather(*(one(i) for i in range(4)))
        return took, time.monotonic() - t0

    took, wall = asyncio.run(group())
    for t, e in zip(took, expect):
        assert e - 0.005 <= t < e + 0.15
    assert wall < sum(expect)  # asyncio.sleep: rollouts think at the same time


@pytest.mark.parametrize("traces, kw, msg", [
    ([], {}, "traces is empty"),
    ("ls", {}, "sequence of traces"),
    (["ls"], {}, "a trace of one command is a list"),
    ([[42]], {}, "trace 0 call 0"),
    ([[ToolCall("bash", {"command": "ls"}), 1.5]], {}, "trace 0 call 1"),
    ([["ls"]], {"think_s": -1}, "think_s must be a finite number"),
    ([["ls"]], {"think_s": float("nan")}, "think_s must be a finite number"),
    ([["ls"]], {"jitter": 1.5}, "jitter must be a number in [0, 1]"),
    ([["ls"]], {"seed": "x"}, "seed must be an int"),
])
def test_replay_validation(traces, kw, msg):
    with pytest.raises(RolloutError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        ReplayPolicy(traces, **kw)


def test_replay_callable_think_time_checked_when_used():
    pol = ReplayPolicy([["ls"]], think_s=lambda step: -1.0)
    with pytest.raises(RolloutError, match=r"think_s\(0\)"):
        act(pol, hist())


def test_replay_save_and_load(tmp_path):
    pol = ReplayPolicy([["ls -la", ToolCall("write_file", {"path": "/x", "content": "é\n"})], []])
    p = tmp_path / "traces.jsonl"
    pol.save(p)
    lines = p.read_text(encoding="utf-8").splitlines()
    assert json.loads(lines[0]) == [["bash", {"command": "ls -la"}],
                                    ["write_file", {"path": "/x", "content": "é\n"}]]
    again = ReplayPolicy.load(p, think_s=0.1, seed=3)
    assert again.traces == pol.traces and again.think_s == 0.1 and again.seed == 3
    p.write_text('["echo hi", ["python", {"code": "print(1)"}]]\n\n')
    assert ReplayPolicy.load(p).traces == ((ToolCall("bash", {"command": "echo hi"}),
                                            ToolCall("python", {"code": "print(1)"})),)
    for bad, msg in [("{}", "must be a JSON list"), ("[1]", r"call 0 must be \[name"),
                     ("[[\"bash\", {\"command\": 1.5}]]", "floats"), ("[", "not JSON")]:
        p.write_text("[]\n" + bad + "\n")
        with pytest.raises(RolloutError, match=f"traces.jsonl:2: .*{msg}"):
            ReplayPolicy.load(p)


# -- a chat-completions server ------------------------------------------------------------

@pytest.fixture
def server():
    s = ChatServer()
    yield s
    s.close()


def policy(server, **kw) -> OpenAIPolicy:
    kw.setdefault("backoff_s", 0)
    return OpenAIPolicy(server.url, "qwen-test", **kw)


def test_openai_request_and_replies(server):
    task = Task(id="t9", prompt="make /out.txt say hi", tools=("bash", "write_file"))
    pol = policy(server, api_key="sk-test", temperature=0.7, top_p=0.9, max_tokens=256, seed=100,
                 extra_body={"top_k": 20}, max_observation_chars=100)
    assert isinstance(pol, Policy)
    server.reply(tool_reply("write_file", '{"path": "/out.txt", "content": "hi\\n"}'))
    call = act(pol, History(task, index=3))
    assert call == ToolCall("write_file", {"path": "/out.txt", "content": "hi\n"})

    req = server.requests[0]
    assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer sk-test"
    body = req["body"]
    assert body["model"] == "qwen-test"
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.7, 0.9, 256)
    assert body["seed"] == 103 and body["top_k"] == 20
    assert body["tools"] == [BUILTIN_TOOL_SCHEMAS["bash"], BUILTIN_TOOL_SCHEMAS["write_file"]]
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert body["messages"][1]["content"] == "make /out.txt say hi"

    # the next step sees the turn: the assistant's call and the (truncated) observation
    long_out = "A" * 80 + "B" * 80
    h = History(task, index=3, turns=[Turn(call, "", 0), Turn(ToolCall("bash", {"command": "cat /out.txt"}),
                                                              long_out, 1)])
    server.reply(text_reply("done: /out.txt says hi"))
    assert act(pol, h) == Final("done: /out.txt says hi")
    msgs = server.requests[1]["body"]["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert msgs[2]["tool_calls"] == [{"id": "call_0", "type": "function", "function": {
        "name": "write_file", "arguments": json.dumps({"path": "/out.txt", "content": "hi\n"})}}]
    assert msgs[3] == {"role": "tool", "tool_call_id": "call_0", "content": ""}
    assert msgs[4]["tool_calls"][0]["id"] == "call_1" and msgs[5]["tool_call_id"] == "call_1"
    obs = msgs[5]["content"]
    assert obs.startswith("A" * 50) and "[... 60 characters omitted ...]" in obs
    assert obs.endswith("B" * 50 + "\n[exit code 1]")
    # the same history gives the same request (ids stable): what a prefix cache relies on
    server.reply(text_reply("again"))
    act(pol, h)
    assert server.requests[2]["body"]["messages"] == msgs

    s = pol.stats
    assert (s.requests, s.replies, s.retries, s.failures) == (3, 3, 0, 0)
    assert (s.prompt_tokens, s.completion_tokens, s.total_tokens) == (200, 20, 220)
    assert len(s.latencies_s) == 3 and s.gen_s == pytest.approx(sum(s.latencies_s))
    assert s.as_dict()["latency_max_s"] == max(s.latencies_s)


def test_openai_takes_the_first_of_several_calls(server):
    pol = policy(server)
    server.reply(tool_reply("bash", '{"command": "ls"}', n=3))
    assert act(pol, hist()) == ToolCall("bash", {"command": "ls"})
    assert pol.stats.extra_tool_calls == 2
    assert "seed" not in server.requests[0]["body"] and "tool_choice" not in server.requests[0]["body"]


def test_openai_retries_a_server_error(server):
    pol = policy(server, max_retries=2)
    server.reply({"error": {"message": "overloaded"}}, status=500)
    server.reply({"error": {"message": "slow down"}}, status=429)
    server.reply(tool_reply("bash", '{"command": "pytest -x"}'))
    assert act(pol, hist()) == ToolCall("bash", {"command": "pytest -x"})
    assert (pol.stats.requests, pol.stats.retries, pol.stats.replies) == (3, 2, 1)
    assert server.requests[0]["body"] == server.requests[2]["body"]


@pytest.mark.parametrize("bad", [
    tool_reply("bash", '{"command": "ls"'),               # truncated JSON
    tool_reply("bash", '["ls"]'),                          # not an object
    tool_reply("bash", '{"cmd": "ls"}'),                   # missing the required argument
    tool_reply("bash", '{"command": "ls", "x": "1"}'),     # unknown argument
    tool_reply("bash", '{"command": 3}'),                  # wrong type
    tool_reply("python", '{"code": "1"}'),                 # a tool the task does not offer
])
def test_openai_resamples_a_malformed_call(server, bad):
    task = Task(id="t", prompt="p", tools=("bash",))
    pol = policy(server, max_retries=1)
    server.reply(bad)
    server.reply(tool_reply("bash", '{"command": "ls"}'))
    assert act(pol, History(task)) == ToolCall("bash", {"command": "ls"})
    assert (pol.stats.bad_replies, pol.stats.retries, pol.stats.failures) == (1, 1, 0)


def test_openai_gives_up_after_max_retries(server):
    pol = policy(server, max_retries=2)
    for _ in range(3):
        server.reply(tool_reply("bash", "{not json"))
    with pytest.raises(PolicyError, match=r"after 3 attempt\(s\); last: unusable reply: tool 'bash': arguments are not JSON"):
        act(pol, hist())
    assert (len(server.requests), pol.stats.failures, pol.stats.bad_replies) == (3, 1, 3)


def test_openai_client_error_is_not_retried(server):
    pol = policy(server, max_retries=3)
    server.reply({"error": {"message": "model 'qwen-test' does not exist"}}, status=404)
    with pytest.raises(PolicyError, match="HTTP 404.*does not exist"):
        act(pol, hist())
    assert len(server.requests) == 1


def test_openai_timeout(server):
    pol = policy(server, timeout=0.3, max_retries=1)
    server.reply(text_reply("too late"), delay=5)
    server.reply(text_reply("too late"), delay=5)
    t0 = time.monotonic()
    with pytest.raises(PolicyError, match=r"after 2 attempt\(s\); last: no reply within 0.3 s"):
        act(pol, hist())
    assert 0.55 < time.monotonic() - t0 < 3
    assert pol.stats.requests == 2 and pol.stats.replies == 0


def test_openai_unreachable_server():
    pol = OpenAIPolicy("http://127.0.0.1:9/v1", "m", max_retries=0)
    with pytest.raises(PolicyError, match="cannot reach http://127.0.0.1:9/v1"):
        act(pol, hist())


def test_openai_tools_and_validation():
    pol = OpenAIPolicy("http://x/v1", "m", tools={"submit": {"description": "Submit.", "parameters": {
        "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}})
    task = Task(id="t", prompt="p", tools=("bash", "submit"))
    assert [t["function"]["name"] for t in pol.tools_for(History(task))] == ["bash", "submit"]
    assert pol.tools_for(History(Task(id="t", prompt="p", tools=()))) == []
    with pytest.raises(PolicyError, match=r"tool\(s\) \['grep'\] that have no JSON schema"):
        pol.tools_for(History(Task(id="t", prompt="p", tools=("grep",))))
    for kw, msg in [({"temperature": 3}, "temperature"), ({"top_p": -0.1}, "top_p"),
                    ({"max_tokens": 0}, "max_tokens"), ({"timeout": 0}, "timeout"),
                    ({"max_retries": -1}, "max_retries"), ({"seed": 1.5}, "seed"),
                    ({"max_observation_chars": 10}, "max_observation_chars"),
                    ({"tools": {"x": {"function": {"name": "y"}}}}, r"tools\['x'\]")]:
        with pytest.raises(RolloutError, match=msg):
            OpenAIPolicy("http://x/v1", "m", **kw)
    with pytest.raises(RolloutError, match="model"):
        OpenAIPolicy("http://x/v1", "")


def test_openai_policy_survives_event_loops(server):
    """Each asyncio.run is a new loop; the policy's client follows (httpx pools are per loop)."""
    pol = policy(server)
    for i in range(3):
        server.reply(tool_reply("bash", json.dumps({"command": f"echo {i}"})))
        assert act(pol, hist()) == ToolCall("bash", {"command": f"echo {i}"})

    async def concurrent():
        for i in range(4):
            server.reply(text_reply("ok"))
        try:
            return await asyncio.gather(*(pol.act(hist(i)) for i in range(4)))
        finally:
            await pol.aclose()

    assert asyncio.run(concurrent()) == [Final("ok")] * 4
