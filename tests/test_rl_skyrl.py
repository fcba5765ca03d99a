"""The SkyRL-gym text environment on real workspaces, driven as SkyRL's generator drives an
environment: make, init, step until done, get_metrics, close; a group from one set-up state."""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor

import pytest

skyrl_gym = pytest.importorskip("skyrl_gym")
from omegaconf import DictConfig  # noqa: E402

import bunshin  # noqa: E402
from bunshin.rl import RolloutError, Task  # noqa: E402
from bunshin.rl.skyrl import ENV_ID, TEMPLATES, BunshinTextEnv  # noqa: E402

FIXED = "def add(a, b):\n    return a + b\n"
TASK = {
    "id": "calc",
    "workdir": "/repo",
    "setup": [
        "mkdir -p /repo && cd /repo && git init -q && git config user.email a@b && git config user.name a",
        "printf 'def add(a, b):\\n    return a - b\\n' > calc.py",
        "printf 'from calc import add\\nassert add(2, 3) == 5, add(2, 3)\\nprint(\"ok\")\\n' > test_calc.py",
        "git config core.pager cat && git add -A && git commit -qm base && export PYTHONDONTWRITEBYTECODE=1",
        {"name": "write_file", "args": {"path": "/srv/setup.txt", "content": "set up\n"}},
    ],
}
REWARD = {"command": "python3 test_calc.py && git diff --quiet -- test_calc.py", "timeout": 60}
PROMPT = [{"role": "system", "content": "Use <tool><bash>...</bash></tool>; answer with <solution>...</solution>."},
          {"role": "user", "content": "Make add() add."}]
CONFIG = DictConfig({"timeout": 10, "max_observation_chars": 4096})  # as skyrl_gym_config.bunshin

FIX = [
    "Let me run the test.\n<tool><bash>python3 test_calc.py</bash></tool>",
    "<tool><read_file>/repo/calc.py</read_file></tool>",
    f"<tool><write_file>/repo/calc.py\n{FIXED}</write_file></tool>",
    "<tool><bash>python3 test_calc.py && git diff --stat</bash></tool>",
    "The test passes now. <solution>add() fixed</solution>",
]
GIVE_UP = [
    "<tool><bash>cat calc.py</bash></tool>",
    "I am not sure; no tool here.",
    "<tool><rm_rf>/</rm_rf></tool>",
    "<solution>nothing</solution>",
]


def agent_loop(outputs: list[str], extras: dict, max_turns: int = 10, env_config=CONFIG):
    """SkyRL's agent_loop without the model: make, init, step until done, metrics, close.
    Returns (chat history, per-step rewards, metadata, metrics, workspace contents at the end)."""
    extras = {**extras, "max_turns": max_turns}  # the generator sets it
    env = skyrl_gym.make(ENV_ID, env_config=env_config, extras=extras)
    chat = copy.deepcopy(PROMPT)
    chat, _ = env.init(chat)
    rewards, metas, done, it = [], [], False, iter(outputs)
    while not done:
        output = next(it)
        out = env.step(output)
        chat += [{"role": "assistant", "content": output}, *out["observations"]]
        rewards.append(out["reward"])
        metas.append(out["metadata"])
        done = out["done"]
    metrics = env.get_metrics()
    ws = env.workspace
    state = ws.read_file("/repo/calc.py").decode()
    env.close()
    assert ws.closed
    return chat, rewards, metas, metrics, state


@pytest.fixture
def templates(no_leaks):
    yield TEMPLATES
    TEMPLATES.close()


def test_multi_step_task(templates):
    builds = templates.builds
    chat, rewards, metas, metrics, state = agent_loop(FIX, {"task": TASK, "reward_spec": REWARD})
    assert templates.builds == builds + 1
    assert rewards == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert state == FIXED
    obs = [m["content"] for m in chat if m["role"] == "user"][1:]
    assert "AssertionError: -1" in obs[0] and obs[0].endswith("[exit code 1]")
    assert obs[1] == "def add(a, b):\n    return a - b\n"
    assert obs[2] == "wrote 32 bytes to /repo/calc.py"
    assert obs[3].startswith("ok\n calc.py | 2 +-")
    assert [m.get("tool_name") for m in metas[:4]] == ["bash", "read_file", "write_file", "bash"]
    assert [m.get("exit_code") for m in metas[:4]] == [1, 0, 0, 0]
    assert metas[4]["verifier"]["passed"] and metas[4]["verifier"]["output"] == "ok\n"
    assert metrics == {"steps": 5, "tool_errors": 0, "reward": 1.0}


def test_group_from_one_setup_state(templates):
    """A group as SkyRL runs it: one environment per trajectory, stepped in a thread pool;
    the setup runs once and every member forks its snapshot."""
    builds = templates.builds
    extras = {"task": TASK, "reward_spec": REWARD}
    pool = ThreadPoolExecutor(4, thread_name_prefix="skyrl-gym-env-")

    async def group():
        loop = asyncio.get_running_loop()
        scripts = [FIX, GIVE_UP, FIX, GIVE_UP]
        return await asyncio.gather(*(loop.run_in_executor(pool, agent_loop, s, extras) for s in scripts))

    try:
        results = asyncio.run(group())
    finally:
        pool.shutdown()
    assert templates.builds == builds + 1
    assert [r[1][-1] for r in results] == [1.0, 0.0, 1.0, 0.0]
    assert [r[4] for r in results] == [FIXED, "def add(a, b):\n    return a - b\n"] * 2
    give_up = results[1]
    obs = [m["content"] for m in give_up[0] if m["role"] == "user"][1:]
    assert obs[1] == "Error: No <tool>...</tool> block found in action string."
    assert obs[2] == "Error: Tool 'rm_rf' not found in any registered tool group."
    assert give_up[3] == {"steps": 4, "tool_errors": 2, "reward": 0.0}
    assert give_up[2][-1]["verifier"]["passed"] is False


def test_fork_mid_episode_and_max_turns(templates):
    env = BunshinTextEnv(CONFIG, {"task": TASK, "reward_spec": REWARD, "max_turns": 4})
    kids = []
    try:
        env.init(copy.deepcopy(PROMPT))
        assert env.workspace.read_file("/srv/setup.txt") == b"set up\n"
        env.step("<tool><bash>cd /tmp && export SEEN=before-fork</bash></tool>")
        kids = env.fork(2)
        for k in kids:
            assert k.turns == 1 and k.chat_history == env.chat_history
            assert k.step("<tool><bash>echo $SEEN $PWD</bash></tool>")["observations"][0]["content"] == \
                "before-fork /tmp\n"
        kids[0].step(f"<tool><write_file>/repo/calc.py\n{FIXED}</write_file></tool>")
        out = kids[0].step("<tool><bash>echo not run</bash></tool>")  # the 4th step: max_turns
        assert (out["done"], out["reward"], out["observations"]) == (True, 1.0, [])
        out = kids[1].step("<solution>x</solution>")
        assert (out["done"], out["reward"]) == (True, 0.0)
        assert env.step("<tool><bash>cat /repo/calc.py</bash></tool>")["observations"][0]["content"] == \
            "def add(a, b):\n    return a - b\n"
    finally:
        for k in kids:
            k.close()
        env.close()


def test_template_and_reward_fn(no_leaks):
    base = bunshin.Workspace.create()
    try:
        base.run("mkdir -p /w && echo 1 > /w/n")
        with base.snapshot() as tpl:
            seen = []

            def reward(ws, chat):
                seen.append(len(chat))
                return float(ws.read_file("/w/n").strip())

            env = BunshinTextEnv(None, {"template": tpl, "task": {"workdir": "/w"}, "reward_spec": {"fn": reward}})
            try:
                env.init([{"role": "user", "content": "double it"}])
                env.step("<tool><python>open('/w/n', 'w').write('2')</python></tool>")
                assert env.step("<solution/> <solution>done</solution>")["reward"] == 2.0
                assert seen == [4]
            finally:
                env.close()
            assert base.read_file("/w/n") == b"1\n"
    finally:
        base.close()


def test_verifier_failures_are_recorded(templates):
    for spec, what in [({"fn": lambda ws, chat: 1 / 0}, "ZeroDivisionError"),
                       ({"fn": lambda ws, chat: float("nan")}, "finite number"),
                       ({"command": "sleep 30", "timeout": 0.5}, "timed out")]:
        env = BunshinTextEnv(None, {"task": TASK, "reward_spec": spec})
        try:
            env.init(copy.deepcopy(PROMPT))
            out = env.step("<solution>x</solution>")
            assert (out["done"], out["reward"]) == (True, 0.0)
            v = out["metadata"]["verifier"]
            assert what in v["error"]
        finally:
            env.close()


def test_validation():
    with pytest.raises(RolloutError, match="needs 'task'"):
        BunshinTextEnv(None, {"reward_spec": REWARD})
    with pytest.raises(RolloutError, match="reward_spec"):
        BunshinTextEnv(None, {"task": TASK})
    with pytest.raises(RolloutError, match="a field Task does not"):
        BunshinTextEnv(None, {"task": {"image": "x"}, "reward_spec": REWARD})
    env = BunshinTextEnv(None, {"task": Task(id="t", prompt=""), "reward_spec": REWARD})
    with pytest.raises(RolloutError, match="before init"):
        _ = env.workspace
