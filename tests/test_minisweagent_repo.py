"""mini-swe-agent's real DefaultAgent and LitellmModel on the repo workload (more-itertools
with a bug), the model served by the local chat-completions server as an OpenAI-compatible
endpoint: a multi-step fix, checked in the workspace and in what the server received."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # offline: no fetch of the price list
if "MSWEA_GLOBAL_CONFIG_DIR" not in os.environ:
    os.environ["MSWEA_GLOBAL_CONFIG_DIR"] = _cfg = tempfile.mkdtemp(prefix="mswea-test-")
    atexit.register(shutil.rmtree, _cfg, True)

yaml = pytest.importorskip("yaml")
pytest.importorskip("minisweagent")
pytest.importorskip("litellm")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from chat_server import ChatServer, text_reply, tool_reply  # noqa: E402
from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.config import get_config_path  # noqa: E402
from minisweagent.models.litellm_model import LitellmModel  # noqa: E402

from bench.workloads.repo import TARGETS  # noqa: E402
from bench.workloads.repo import make as make_repo  # noqa: E402
from bunshin.rl.minisweagent import BunshinEnvironment  # noqa: E402
from bunshin.rl.workspaces import build  # noqa: E402

CONFIG = yaml.safe_load(get_config_path("default").read_text())
PYTEST = "python3 -m pytest -q -p no:cacheprovider"
TAKE_TESTS = f"{PYTEST} tests/test_recipes.py -k TakeTests 2>&1 | tail -3"
# the workload's own realistic bug for take(): one item short
BUG = TARGETS["take"][3]
COMMANDS = [
    "git log --oneline -2 && git status --short",
    TAKE_TESTS,
    "grep -n 'def take' -A 12 more_itertools/recipes.py",
    "curl -s 'http://127.0.0.1:8765/def?name=take'",
    "sed -i 's/return list(islice(iterable, n - 1))/return list(islice(iterable, n))/' more_itertools/recipes.py "
    "&& git diff --stat",
    f"{TAKE_TESTS} && {PYTEST} tests/ 2>&1 | tail -1",
    "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff",
]


@pytest.fixture
def server():
    s = ChatServer()
    yield s
    s.close()


@pytest.mark.slow
def test_default_agent_fixes_the_repo(no_leaks, server, monkeypatch):
    monkeypatch.setenv("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")  # a bad reply fails the test at once
    try:
        task = make_repo(1, quick=True).task
    except RuntimeError as e:  # neither cached nor downloadable
        pytest.skip(str(e))
    ws, _ = build(task, "mswea")
    with BunshinEnvironment(workspace=ws, own_workspace=True, cwd="/repo", timeout=120,
                            env={**CONFIG["environment"]["env"], "PYTHONDONTWRITEBYTECODE": "1"}) as env:
        r = ws.run(f"sed -i '{BUG}' more_itertools/recipes.py && git commit -qam 'take: faster' && git log --oneline -1",
                   cwd="/repo")
        assert r.ok, r.output

        for i, c in enumerate(COMMANDS):
            if i == 3:  # a reply without a tool call: the agent's format error, then on
                server.reply(text_reply("I think the bug is in take()."))
            server.reply(tool_reply("bash", json.dumps({"command": c})))
        model = LitellmModel(**{**CONFIG["model"], "model_name": "openai/bunshin-test", "cost_tracking": "ignore_errors",
                                "model_kwargs": {"api_base": server.url, "api_key": "sk-bunshin", "drop_params": True}})
        agent = DefaultAgent(model, env, **CONFIG["agent"])
        result = agent.run("take(n, iterable) returns one item too few. Find the bug and fix it.")

        # the agent's own exit
        assert result["exit_status"] == "Submitted"
        assert "-    return list(islice(iterable, n - 1))\n+    return list(islice(iterable, n))" in result["submission"]
        # the workspace's real state: fixed, the suite passes, nothing else touched
        assert b"return list(islice(iterable, n))\n" in ws.read_file("/repo/more_itertools/recipes.py")
        out = env.execute({"command": f"{PYTEST} tests/ 2>&1 | tail -1; git status --short"})
        assert out["returncode"] == 0 and " passed" in out["output"] and "failed" not in out["output"]
        assert out["output"].rstrip().endswith("M more_itertools/recipes.py")
        assert ws.run("curl -sf http://127.0.0.1:8765/health").ok, "the language server still answers"

        # what the model was shown, through mini-swe-agent's own observation template
        tools = [m for m in agent.messages if m["role"] == "tool"]
        assert len(tools) == len(COMMANDS) - 1  # the submit ends the run
        assert "<returncode>0</returncode>" in tools[0]["content"] and "take: faster" in tools[0]["content"]
        assert "2 failed, 2 passed" in tools[1]["content"]
        assert '"path": "/repo/more_itertools/recipes.py"' in tools[3]["content"]
        assert "passed" in tools[5]["content"] and "failed" not in tools[5]["content"]

    # what the server received: every request of the loop, as an OpenAI client sends it
    reqs = server.requests
    assert len(reqs) == len(COMMANDS) + 1 and not server.script
    assert all(q["path"] == "/v1/chat/completions" and q["auth"] == "Bearer sk-bunshin" for q in reqs)
    assert all(q["body"]["model"] == "bunshin-test" for q in reqs)
    assert all([t["function"]["name"] for t in q["body"]["tools"]] == ["bash"] for q in reqs)
    first = reqs[0]["body"]["messages"]
    assert [m["role"] for m in first] == ["system", "user"] and "one item too few" in first[1]["content"]
    second = reqs[1]["body"]["messages"]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "tool"]
    assert json.loads(second[2]["tool_calls"][0]["function"]["arguments"]) == {"command": COMMANDS[0]}
    assert second[3]["tool_call_id"] == "srv_0"
    after_bad = reqs[4]["body"]["messages"]
    # mini-swe-agent keeps the format error, not the reply without a tool call
    assert [m["role"] for m in after_bad[-3:]] == ["assistant", "tool", "user"]
    assert "No tool calls found" in after_bad[-1]["content"] and "I think" not in json.dumps(after_bad)
    last = reqs[-1]["body"]["messages"]
    assert len(last) == 2 + 2 * (len(COMMANDS) - 1) + 1
    assert "tests/test_recipes.py" in json.dumps(last) and "passed" in last[-1]["content"]
