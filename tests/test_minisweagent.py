"""mini-swe-agent's real agent loop (DefaultAgent + its DeterministicModel) on Bunshin
workspaces, forks included."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading

import pytest

# before minisweagent is imported: no banner, no ~/.config/mini-swe-agent, no .env picked up
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
if "MSWEA_GLOBAL_CONFIG_DIR" not in os.environ:
    os.environ["MSWEA_GLOBAL_CONFIG_DIR"] = _cfg = tempfile.mkdtemp(prefix="mswea-test-")
    atexit.register(shutil.rmtree, _cfg, True)

yaml = pytest.importorskip("yaml")
minisweagent = pytest.importorskip("minisweagent")

from minisweagent.agents.default import DefaultAgent
from minisweagent.config import get_config_path
from minisweagent.environments import get_environment
from minisweagent.exceptions import Submitted
from minisweagent.models.test_models import DeterministicModel, make_output

import bunshin
from bunshin.rl import RolloutError
from bunshin.rl.minisweagent import BunshinEnvironment

CONFIG = yaml.safe_load(get_config_path("default").read_text())  # mini-swe-agent's own default config

BUGGY = "def add(a, b):\n    return a - b\n"
SETUP = ["printf 'def add(a, b):\\n    return a - b\\n' > calc.py",
         "printf 'from calc import add\\nassert add(2, 3) == 5, add(2, 3)\\nprint(\"ok\")\\n' > test_calc.py"]


def agent_for(env: BunshinEnvironment, commands: list[str]) -> DefaultAgent:
    """A DefaultAgent whose model answers ``commands`` in turn (then must have submitted)."""
    outputs = [make_output(f"THOUGHT: step {i}\n\n```mswea_bash_command\n{c}\n```", [{"command": c}], cost=0.0)
               for i, c in enumerate(commands)]
    model = DeterministicModel(outputs=outputs, observation_template=CONFIG["model"]["observation_template"])
    return DefaultAgent(model, env, **CONFIG["agent"])


# "a - b" -> "a + b" within a second keeps calc.py's size and mtime: a stale .pyc would be used
ENV = {**CONFIG["environment"]["env"], "PYTHONDONTWRITEBYTECODE": "1"}


def env_kwargs(**kw):
    return {**CONFIG["environment"], "env": ENV, "cwd": "/repo", "setup": SETUP, **kw}


def test_execute(no_leaks):
    with BunshinEnvironment(**env_kwargs(env={**ENV, "GREETING": "hi"}, timeout=1)) as env:
        assert env.execute({"command": "cat calc.py"}) == {"output": BUGGY, "returncode": 0, "exception_info": ""}
        out = env.execute({"command": "echo a; echo b >&2; echo c; echo $GREETING $PAGER; pwd"})
        assert out["output"] == "a\nb\nc\nhi cat\n/repo\n"  # stderr interleaved, config env applied
        out = env.execute({"command": "cd /tmp; ls /nope"})
        assert out["returncode"] == 2 and "No such file or directory" in out["output"]
        assert env.execute({"command": "pwd"})["output"] == "/repo\n"  # each command: a new shell
        assert env.execute({"command": "pwd"}, cwd="/tmp")["output"] == "/tmp\n"
        assert env.execute({"command": "nosuchcmd"})["returncode"] == 127

        out = env.execute({"command": "echo started; sleep 30"})
        assert out["returncode"] == -1 and out["output"] == "started\n"
        assert "timed out after 1 seconds" in out["exception_info"]
        assert out["extra"]["exception_type"] == "TimeoutExpired"
        assert env.execute({"command": "sleep 1.5; echo late"}, timeout=5)["output"] == "late\n"

        out = env.execute({"command": "true"}, cwd="/does/not/exist")
        assert out["returncode"] == -1 and "/does/not/exist" in out["exception_info"]

        with pytest.raises(Submitted) as e:
            env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; cat calc.py"})
        assert e.value.messages[0]["extra"] == {"exit_status": "Submitted", "submission": BUGGY}

        tv = env.get_template_vars(task="x")
        assert tv["cwd"] == "/repo" and tv["system"] == "Linux" and tv["task"] == "x"
        info = env.serialize()["info"]
        assert info["config"]["environment_type"] == "bunshin.rl.minisweagent.BunshinEnvironment"
        assert info["bunshin"]["workspace_id"] == env.workspace.id
    assert env.workspace.closed


def test_config_and_errors(no_leaks):
    env = get_environment({"environment_class": "bunshin.rl.minisweagent.BunshinEnvironment", "cwd": "/w"})
    try:
        assert isinstance(env, BunshinEnvironment)
        assert env.execute({"command": "pwd"})["output"] == "/w\n"
    finally:
        env.close()
    with pytest.raises(RolloutError, match="setup command 1 'exit 4' exited 4"):
        BunshinEnvironment(setup=["true", "exit 4"])
    with pytest.raises(RolloutError, match="cwd must be an absolute path"):
        BunshinEnvironment(cwd="repo")
    # a workspace passed in stays the caller's
    with bunshin.Workspace.create() as ws:
        env = BunshinEnvironment(workspace=ws)
        assert env.execute({"command": "echo $((6*7))"})["output"] == "42\n"
        env.close()
        assert not ws.closed


def test_default_agent_runs_on_a_workspace(no_leaks):
    with BunshinEnvironment(**env_kwargs()) as env:
        agent = agent_for(env, [
            "python3 test_calc.py",
            "sed -i 's/a - b/a + b/' calc.py && python3 test_calc.py",
            "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat calc.py",
        ])
        result = agent.run("make add() add")
        assert result == {"exit_status": "Submitted", "submission": "def add(a, b):\n    return a + b\n"}
        # the workspace's real state
        assert env.workspace.read_file("/repo/calc.py") == b"def add(a, b):\n    return a + b\n"
        assert env.execute({"command": "python3 test_calc.py"})["output"] == "ok\n"
        # what the model was shown: mini-swe-agent's own observation template over our outputs
        roles = [m["role"] for m in agent.messages]
        assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant", "exit"]
        assert "make add() add" in agent.messages[1]["content"]
        first = agent.messages[3]
        assert "<returncode>1</returncode>" in first["content"] and "AssertionError: -1" in first["content"]
        assert "<returncode>0</returncode>" in agent.messages[5]["content"]
        assert agent.serialize()["info"]["bunshin"]["workspace_id"] == env.workspace.id


def test_two_agents_on_two_forks_diverge(no_leaks):
    with BunshinEnvironment(**env_kwargs()) as base:
        base.execute({"command": "echo shared > notes.txt"})
        kids = base.fork(2)
        try:
            scripts = [
                ["sed -i 's/a - b/a + b/' calc.py", "echo A > A.txt && python3 test_calc.py",
                 "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat calc.py"],
                ["sed -i 's/a - b/b + a/' calc.py", "echo B > B.txt && rm notes.txt",
                 "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat calc.py"],
            ]
            agents = [agent_for(k, s) for k, s in zip(kids, scripts)]
            results: list = [None, None]

            def run(i):
                results[i] = agents[i].run("fix add")

            threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert results[0]["submission"] == "def add(a, b):\n    return a + b\n"
            assert results[1]["submission"] == "def add(a, b):\n    return b + a\n"

            ls = [k.execute({"command": "ls"})["output"].split() for k in kids]
            assert ls[0] == ["A.txt", "calc.py", "notes.txt", "test_calc.py"]
            assert ls[1] == ["B.txt", "calc.py", "test_calc.py"]
            # the parent is untouched and still usable
            assert base.execute({"command": "ls; cat calc.py"})["output"] == "calc.py\nnotes.txt\ntest_calc.py\n" + BUGGY
            assert kids[0].workspace.id != kids[1].workspace.id != base.workspace.id
        finally:
            for k in kids:
                k.close()
        assert all(k.workspace.closed for k in kids) and not base.workspace.closed


def test_from_template(no_leaks):
    with BunshinEnvironment(**env_kwargs()) as base:
        tpl = base.snapshot()
        try:
            envs = BunshinEnvironment.from_template(tpl, 3, **env_kwargs(env={**ENV, "N": "x"}))
            try:
                for i, e in enumerate(envs):
                    e.execute({"command": f"echo {i} > mine.txt"})
                assert [e.execute({"command": "cat mine.txt; echo $N"})["output"] for e in envs] == \
                    ["0\nx\n", "1\nx\n", "2\nx\n"]
                assert base.execute({"command": "ls"})["output"] == "calc.py\ntest_calc.py\n"
            finally:
                for e in envs:
                    e.close()
        finally:
            tpl.close()
