"""WorkspaceEnv: a gymnasium env on real workspaces (fresh, and forks of a template)."""

from __future__ import annotations

import time

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import bunshin
from bunshin.cache.toolcall import ToolCall
from bunshin.rl import RolloutError, Task
from bunshin.rl.gym import ENV_ID, AnyText, WorkspaceEnv

TASK = Task(id="gym", prompt="Write 'hello' into /repo/answer.txt, then submit.",
            setup=("echo base > /repo/base.txt", "export FOO=from-setup"), workdir="/repo", max_steps=10)


def answer_is_hello(ws, history) -> float:
    r = ws.run("cat /repo/answer.txt")
    return 1.0 if r.ok and r.stdout.strip() == b"hello" else 0.0


def test_check_env_fresh(no_leaks):
    env = gymnasium.make(ENV_ID, task=TASK)
    try:
        check_env(env.unwrapped)
    finally:
        env.close()
    assert env.unwrapped.workspace is None


def test_check_env_fork(no_leaks):
    env = WorkspaceEnv(TASK, mode="fork")
    env.spec = gymnasium.spec(ENV_ID)  # the registered spec: nondeterministic (tool output, timings)
    try:
        check_env(env, skip_close_check=True)
    finally:
        env.close()


def test_spaces():
    sp = AnyText(300)
    assert isinstance(sp, gymnasium.spaces.Text)
    assert sp.contains("") and sp.contains("héllo ☃\x00\n") and not sp.contains("x" * 301)
    assert not sp.contains(b"ls")
    sp.seed(1)
    samples = [sp.sample() for _ in range(50)]
    assert all(isinstance(s, str) and sp.contains(s) and len(s) <= 64 for s in samples)
    sp.seed(1)
    assert [sp.sample() for _ in range(50)] == samples
    assert len(sp.sample(mask=(200, None))) == 200


def test_episode(no_leaks):
    env = WorkspaceEnv(TASK, reward_fn=answer_is_hello, timeout=1.0, max_steps=30)
    try:
        obs, info = env.reset(seed=0)
        assert obs == TASK.prompt and info["episode"] == 0 and info["setup_s"] > 0
        ws = env.workspace
        assert info["workspace_id"] == ws.id

        obs, r, term, trunc, info = env.step("cat base.txt; echo $FOO; pwd")
        assert obs == "base\nfrom-setup\n/repo\n" and (r, term, trunc) == (0.0, False, False)
        assert info["exit_code"] == 0 and info["duration"] > 0 and info["step"] == 0

        obs, r, term, trunc, info = env.step("cd /tmp && X=1; ls /nope")  # the shell persists
        assert info["exit_code"] == 2 and "No such file" in obs
        obs, *_ = env.step("echo $X $PWD")
        assert obs == "1 /tmp\n"

        obs, _, _, _, info = env.step('{"name": "write_file", "args": {"path": "/repo/answer.txt", "content": "hel"}}')
        assert (obs, info["exit_code"]) == ("", 0)
        obs, *_ = env.step('{"name": "read_file", "args": {"path": "/repo/answer.txt"}}')
        assert obs == "hel"
        obs, *_ = env.step('{"name": "python", "args": {"code": "print(6 * 7)"}}')
        assert obs == "42\n"
        obs, *_ = env.step("{ echo a; echo b; }")  # a bash group, not JSON
        assert obs == "a\nb\n"

        # rejected calls: a step with the error as observation
        for bad, msg in [('{"name": "rm_rf", "args": {}}', "no tool named 'rm_rf'"),
                         ('{"args": {}}', '"name" is missing'),
                         ('{"name": "read_file", "args": {"file": "/x"}}', "unknown argument"),
                         ('{"name": "read_file", "args": {"path": "/nope"}}', "/nope")]:
            obs, r, term, trunc, info = env.step(bad)
            assert info["exit_code"] == -1 and msg in info["error"] and obs.startswith("error: ")

        t0 = time.monotonic()
        obs, r, term, trunc, info = env.step("sleep 30")
        assert info["timed_out"] and time.monotonic() - t0 < 10
        obs, *_ = env.step("echo still usable")
        assert obs == "still usable\n"
        assert len(env.history.turns) == 13 and env.history.turns[7].exit_code == -1
        assert env.history.turns[8].call == ToolCall("invalid_action", {"text": '{"args": {}}'})
    finally:
        env.close()


def test_submit_reward_and_episode_end(no_leaks):
    env = WorkspaceEnv(TASK, reward_fn=answer_is_hello)
    try:
        env.reset()
        env.step("printf hello > answer.txt")
        obs, r, term, trunc, info = env.step("  SUBMIT \n")
        assert (obs, r, term, trunc) == ("", 1.0, True, False)
        with pytest.raises(RolloutError, match="episode is over"):
            env.step("ls")
        env.reset()  # a new workspace: the answer is gone
        obs, r, term, trunc, info = env.step('{"name": "submit", "args": {"answer": "nothing"}}')
        assert (r, term, info["answer"]) == (0.0, True, "nothing")
    finally:
        env.close()
    with pytest.raises(bunshin.errors.WorkspaceClosed):
        env.reset()
    env.close()  # idempotent


def test_truncation_and_done_fn(no_leaks):
    calls = []

    def reward(ws, history):
        calls.append(len(history.turns))
        return 0.5

    env = WorkspaceEnv(TASK, reward_fn=reward, max_steps=2)
    try:
        env.reset()
        assert env.step("true")[1:4] == (0.0, False, False)
        assert env.step("true")[1:4] == (0.5, False, True)  # truncated: reward of the last step
        assert calls == [2]
    finally:
        env.close()

    env = WorkspaceEnv(TASK, done_fn=lambda ws, h: ws.run("test -e /repo/done").ok,
                       reward_fn=lambda ws, h: len(h.turns))
    try:
        env.reset()
        assert env.step("echo not yet")[1:4] == (0.0, False, False)
        assert env.step("touch /repo/done")[1:4] == (2.0, True, False)
    finally:
        env.close()

    env = WorkspaceEnv(TASK, reward_fn=lambda ws, h: float("nan"))
    try:
        env.reset()
        with pytest.raises(RolloutError, match="finite number"):
            env.step("submit")
    finally:
        env.close()


def test_template_forks_are_independent_episodes(no_leaks):
    base = bunshin.Workspace.create(workdir="/repo")
    tpl = None
    try:
        base.run("mkdir -p /repo && echo base > /repo/base.txt", cwd="/")
        sh = base.shell(cwd="/repo")
        sh.run("export FOO=live-shell; cd /repo")
        tpl = base.snapshot()
        env = WorkspaceEnv(TASK, template=tpl)
        try:
            obs, info1 = env.reset()
            ws1 = env.workspace
            assert env.step("echo $FOO; cat base.txt")[0] == "live-shell\nbase\n"  # the template's shell
            assert env.step("echo one > /repo/episode.txt")[4]["exit_code"] == 0
            obs, info2 = env.reset()
            assert ws1.closed and info2["workspace_id"] != info1["workspace_id"]
            obs, *_ = env.step("cat base.txt; ls /repo")
            assert obs == "base\nbase.txt\n"  # episode 1's file is absent
            assert "episode.txt" not in base.run("ls /repo").stdout.decode()
        finally:
            env.close()
        assert tpl.fork(1)[0].close() is None  # the caller's template is still open
    finally:
        if tpl is not None:
            tpl.close()
        base.close()


def test_workspace_and_fork_modes(no_leaks):
    base = bunshin.Workspace.create()
    try:
        base.run("mkdir -p /repo && echo mine > /repo/base.txt")
        env = WorkspaceEnv(TASK, workspace=base)
        try:
            env.reset()
            env.step("echo 1 > /repo/e1")
            env.reset()
            assert env.step("ls /repo")[0] == "base.txt\n"
        finally:
            env.close()
        assert base.run("cat /repo/base.txt").stdout == b"mine\n"  # still the caller's, alive
    finally:
        base.close()

    env = WorkspaceEnv(TASK, mode="fork")
    try:
        env.reset()
        assert env.step("echo $FOO; ls")[0] == "from-setup\nbase.txt\n"  # setup ran once, shell kept
        env.step("rm base.txt")
        env.reset()
        assert env.step("ls")[0] == "base.txt\n"
    finally:
        env.close()


def test_validation(no_leaks):
    with pytest.raises(RolloutError, match="task must be"):
        WorkspaceEnv("not a task")
    for kw, msg in [({"mode": "criu"}, "mode"), ({"max_steps": 0}, "max_steps"), ({"timeout": -1}, "timeout"),
                    ({"submit": " "}, "submit"), ({"reward_fn": 3}, "reward_fn"),
                    ({"max_observation_chars": 10}, "max_observation_chars")]:
        with pytest.raises(RolloutError, match=msg):
            WorkspaceEnv(TASK, **kw)
    env = WorkspaceEnv(TASK)
    with pytest.raises(RolloutError, match="before reset"):
        env.step("ls")
    env.reset()
    try:
        with pytest.raises(RolloutError, match="an action is a str"):
            env.step(ToolCall("bash", {"command": "ls"}))
    finally:
        env.close()
    bad = Task(id="bad", prompt="p", setup=("exit 3",))
    env = WorkspaceEnv(bad)
    with pytest.raises(RolloutError, match="setup step 0"):
        env.reset()
    env.close()


def test_only_the_tasks_tools(no_leaks):
    env = WorkspaceEnv(Task(id="bash-only", prompt="p", tools=("bash",)))
    try:
        env.reset()
        obs, r, term, trunc, info = env.step('{"name": "write_file", "args": {"path": "/x", "content": "1"}}')
        assert info["exit_code"] == -1 and "no tool named 'write_file'" in obs and "['bash']" in obs
        assert env.step('{"name": "bash", "args": {"command": "test -e /x || echo absent"}}')[0] == "absent\n"
    finally:
        env.close()
