"""SWE-ReX's deployment/runtime API on real workspaces: driven as SWE-agent drives a
deployment, forked, and under mini-swe-agent's own SWE-ReX environment and DefaultAgent."""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
if "MSWEA_GLOBAL_CONFIG_DIR" not in os.environ:
    os.environ["MSWEA_GLOBAL_CONFIG_DIR"] = _cfg = tempfile.mkdtemp(prefix="mswea-test-")
    atexit.register(shutil.rmtree, _cfg, True)

swerex = pytest.importorskip("swerex")

from swerex.exceptions import (  # noqa: E402
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (  # noqa: E402
    BashAction,
    BashInterruptAction,
    BashObservation,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)

import bunshin  # noqa: E402
from bunshin.rl.swerex import PROMPT, BunshinDeployment  # noqa: E402

BUGGY = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
SETUP = [
    "mkdir -p /repo && cd /repo && git init -q && git config user.email a@b && git config user.name a",
    f"printf '{BUGGY.replace(chr(10), chr(92) + 'n')}' > /repo/calc.py",
    "printf 'from calc import add\\nassert add(2, 3) == 5, add(2, 3)\\nprint(\"ok\")\\n' > /repo/test_calc.py",
    "cd /repo && git add -A && git commit -qm base",
    "echo 'export FROM_BASHRC=yes' > /root/.bashrc",
]
# "a - b" -> "a + b" within a second keeps calc.py's size and mtime: a stale .pyc would be used
ENV = {"PYTHONDONTWRITEBYTECODE": "1"}


def run(coro):
    return asyncio.run(coro)


async def sh(rt, command, **kw) -> BashObservation:
    """SWE-agent's ``communicate``: one command in the default session."""
    return await rt.run_in_session(BashAction(command=command, **kw))


def test_driven_as_swe_agent_drives_a_deployment(no_leaks, tmp_path):
    tools = tmp_path / "tools"
    (tools / "bin").mkdir(parents=True)
    (tools / "bin" / "count_lines").write_text("#!/bin/sh\nwc -l < \"$1\"\n")
    (tools / "bin" / "count_lines").chmod(0o755)
    (tools / "README").write_text("a tool bundle\n")

    async def main():
        dep = BunshinDeployment(workdir="/repo", setup=SETUP, env={**ENV, "PAGER": "cat"})
        with pytest.raises(DeploymentNotStartedError):
            _ = dep.runtime
        assert not await dep.is_alive()
        steps = []
        dep.add_hook(type("H", (), {"on_custom_step": lambda self, m: steps.append(m)})())
        await dep.start()
        rt = dep.runtime
        try:
            assert await dep.is_alive() and steps[0] == "Starting Bunshin workspace"
            await rt.create_session(CreateBashSessionRequest(startup_source=["/root/.bashrc"], startup_timeout=10))
            with pytest.raises(SessionExistsError):
                await rt.create_session(CreateBashSessionRequest())

            # state persists in the session: cd, variables, the startup file's exports
            await sh(rt, "cd /repo && export TASK=fix-add")
            obs = await sh(rt, "echo $TASK $FROM_BASHRC $PAGER; pwd")
            assert (obs.output, obs.exit_code, obs.expect_string) == ("fix-add yes cat\n/repo\n", 0, PROMPT)
            # exit codes as SWE-agent asks for them
            obs = await sh(rt, "python3 test_calc.py", check="silent")
            assert obs.exit_code == 1 and "AssertionError: -1" in obs.output
            assert (await sh(rt, "false", check="ignore")).exit_code is None
            with pytest.raises(NonZeroExitCodeError, match="run the tests: Command 'python3 test_calc.py' failed "
                                                           "with exit code 1"):
                await sh(rt, "python3 test_calc.py", error_msg="run the tests")
            with pytest.raises(BashIncorrectSyntaxError):
                await sh(rt, "if then fi (")
            # several lines and a heredoc are one command
            obs = await sh(rt, "cat > notes.txt <<'EOF'\nline 1\nline 2\nEOF\nwc -l < notes.txt")
            assert obs.output == "2\n"

            # a command that overruns its timeout; then SWE-agent's interrupt; the session lives on
            with pytest.raises(CommandTimeoutError):
                await sh(rt, "sleep 30", timeout=0.5)
            obs = await rt.run_in_session(BashInterruptAction())
            assert obs.expect_string == PROMPT
            assert (await sh(rt, "echo $TASK")).output == "fix-add\n"

            # an interactive program: lines to a REPL, then quit back to bash
            obs = await sh(rt, "python3 -q", is_interactive_command=True, expect=[">>> "], timeout=10)
            assert obs.expect_string == ">>> "
            obs = await sh(rt, "import calc; print(calc.add(2, 3))", is_interactive_command=True,
                           expect=[">>> "], timeout=10)
            assert obs.output == "-1"
            obs = await sh(rt, "quit()", is_interactive_quit=True, timeout=10)
            assert obs.expect_string == PROMPT
            assert (await sh(rt, "pwd")).output == "/repo\n"
            # a REPL takes ^C itself: the interrupt ends its job
            await sh(rt, "python3 -q", is_interactive_command=True, expect=[">>> "], timeout=10)
            obs = await rt.run_in_session(BashInterruptAction(timeout=0.3, n_retry=2))
            assert obs.expect_string == PROMPT and "KeyboardInterrupt" in obs.output
            assert (await sh(rt, "echo $TASK")).output == "fix-add\n"

            # files: SWE-agent's editor reads and writes through the runtime
            assert (await rt.read_file(ReadFileRequest(path="/repo/calc.py"))).content == BUGGY
            await rt.write_file(WriteFileRequest(path="/repo/calc.py", content=FIXED))
            await rt.write_file(WriteFileRequest(path="/repo/new/dir/x.txt", content="deep"))
            assert (await rt.read_file(ReadFileRequest(path="new/dir/x.txt"))).content == "deep"
            assert (await sh(rt, "python3 test_calc.py && git status --short")).output == \
                "ok\n M calc.py\n?? new/\n?? notes.txt\n"

            # its tool bundle: uploaded from the host, put on PATH, run
            await rt.upload(UploadRequest(source_path=str(tools), target_path="/root/tools/demo"))
            await sh(rt, "export PATH=/root/tools/demo/bin:$PATH")
            assert (await sh(rt, "count_lines notes.txt; cat /root/tools/demo/README")).output == \
                "2\na tool bundle\n"
            await rt.upload(UploadRequest(source_path=str(tools / "README"), target_path="/tmp/README"))
            assert dep.workspace.read_file("/tmp/README") == b"a tool bundle\n"

            # execute: a subprocess.run outside the session
            r = await rt.execute(Command(command=["git", "diff", "--stat"], cwd="/repo"))
            assert r.exit_code == 0 and "calc.py | 2 +-" in r.stdout and r.stderr == ""
            r = await rt.execute(Command(command="echo out; echo err >&2; exit 3", shell=True))
            assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 3)
            r = await rt.execute(Command(command="echo out; echo err >&2", shell=True, merge_output_streams=True))
            assert (r.stdout, r.stderr) == ("out\nerr\n", "")
            r = await rt.execute(Command(command="echo $A $PAGER; pwd", shell=True, env={"A": "1"}, cwd="/tmp"))
            assert r.stdout == "1 cat\n/tmp\n"
            with pytest.raises(NonZeroExitCodeError):
                await rt.execute(Command(command="exit 2", shell=True, check=True))
            with pytest.raises(CommandTimeoutError):
                await rt.execute(Command(command=["sleep", "30"], timeout=0.5))

            await rt.close_session(CloseBashSessionRequest())
            with pytest.raises(SessionDoesNotExistError):
                await sh(rt, "true")
            ws = dep.workspace
        finally:
            await dep.stop()
        assert ws.closed and not await dep.is_alive()
        await dep.stop()  # idempotent

    run(main())


class SweAgentEnv:
    """SWE-agent's SWEEnv call pattern (sweagent/environment/swe_env.py): synchronous methods,
    each one ``asyncio.run`` of one runtime call, on any deployment."""

    def __init__(self, deployment, post_startup_commands=()):
        self.deployment = deployment
        self.post_startup_commands = list(post_startup_commands)

    def start(self):
        asyncio.run(self.deployment.start())
        asyncio.run(self.deployment.runtime.create_session(CreateBashSessionRequest(startup_source=["/root/.bashrc"])))
        self.communicate(" && ".join(f"export {k}={v}" for k, v in {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}.items()),
                         check="raise")
        self.communicate("cd /", check="raise")
        self.communicate(" && ".join(["cd /repo", "export ROOT=$(pwd -P)", "git status", "git reset --hard",
                                      "git checkout master", "git clean -fdq"]), check="raise", timeout=120)
        for c in self.post_startup_commands:
            self.communicate(c, check="raise", timeout=500)

    def communicate(self, input, timeout=25, *, check="ignore"):
        r = asyncio.run(self.deployment.runtime.run_in_session(
            BashAction(command=input, timeout=timeout, check="silent" if check else "ignore")))
        if check != "ignore" and r.exit_code != 0:
            raise RuntimeError(f"Command {input!r} failed ({r.exit_code=})")
        return r.output

    def interrupt_session(self):
        asyncio.run(self.deployment.runtime.run_in_session(BashInterruptAction()))

    def read_file(self, path):
        return asyncio.run(self.deployment.runtime.read_file(ReadFileRequest(path=str(path)))).content

    def write_file(self, path, content):
        asyncio.run(self.deployment.runtime.write_file(WriteFileRequest(path=str(path), content=content)))

    def execute_command(self, command, shell=True, check=False, env=None, cwd=None):
        asyncio.run(self.deployment.runtime.execute(Command(command=command, shell=shell, check=check, env=env,
                                                            cwd=cwd)))

    def close(self):
        asyncio.run(self.deployment.stop())


def test_swe_agent_call_pattern(no_leaks, tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "submit").write_text("#!/bin/bash\ngit -C /repo diff\n")
    (tmp_path / "bin" / "submit").chmod(0o755)
    setup = [s.replace("git init -q", "git init -q -b master") for s in SETUP]
    # SWE-agent's default tool config sets these variables (git's pager on a terminal is less)
    env = SweAgentEnv(BunshinDeployment(setup=setup, env={**ENV, "PAGER": "cat", "GIT_PAGER": "cat"}),
                      post_startup_commands=["export STARTED=1"])
    env.start()
    try:
        # the agent's tool bundle, installed as SWE-agent installs it
        asyncio.run(env.deployment.runtime.upload(UploadRequest(source_path=str(tmp_path), target_path="/root/tools/t")))
        env.execute_command("chmod -R +x /root/tools/t/bin", check=True)
        env.communicate("export PATH=/root/tools/t/bin:$PATH", check="raise")
        assert env.communicate("echo $LANG $STARTED $ROOT $FROM_BASHRC; pwd") == "C.UTF-8 1 /repo yes\n/repo\n"
        env.write_file("/repo/calc.py", env.read_file("/repo/calc.py").replace("a - b", "a + b"))
        assert env.communicate("python3 test_calc.py", check="raise") == "ok\n"
        with pytest.raises(CommandTimeoutError):
            env.communicate("sleep 60", timeout=0.5)
        env.interrupt_session()
        assert "+    return a + b" in env.communicate("submit")
        with pytest.raises(RuntimeError, match="exit_code=1"):
            env.communicate("false", check="warn")
        ws = env.deployment.workspace
    finally:
        env.close()
    assert ws.closed


def test_fork_continues_every_session(no_leaks):
    async def main():
        dep = BunshinDeployment(workdir="/repo", setup=SETUP, env=ENV)
        await dep.start()
        kids: list[BunshinDeployment] = []
        try:
            rt = dep.runtime
            await rt.create_session(CreateBashSessionRequest())
            await rt.create_session(CreateBashSessionRequest(session="repl"))
            await sh(rt, "cd /repo && X=shared")
            await sh(rt, "python3 -q", session="repl", is_interactive_command=True, expect=[">>> "], timeout=10)
            await sh(rt, "n = 41", session="repl", is_interactive_command=True, expect=[">>> "], timeout=10)

            kids = await dep.fork(2)
            for i, k in enumerate(kids):
                assert await k.is_alive() and k.workspace is not dep.workspace
                assert (await sh(k.runtime, "echo $X; pwd")).output == "shared\n/repo\n"
                obs = await sh(k.runtime, f"n += {i + 1}; print(n)", session="repl", is_interactive_command=True,
                               expect=[">>> "], timeout=10)
                assert obs.output == str(42 + i)
                await sh(k.runtime, f"echo kid{i} > mine.txt")
            assert (await sh(kids[0].runtime, "cat mine.txt")).output == "kid0\n"
            assert (await sh(kids[1].runtime, "cat mine.txt")).output == "kid1\n"
            obs = await sh(rt, "ls mine.txt", check="silent")
            assert obs.exit_code == 2  # the source never saw them
            obs = await sh(rt, "print(n)", session="repl", is_interactive_command=True, expect=[">>> "], timeout=10)
            assert obs.output == "41"

            # many forks of one state: a snapshot, then deployments on its forks
            tpl = await dep.snapshot()
            try:
                deps = [BunshinDeployment(template=tpl, workdir="/repo", env=ENV) for _ in range(2)]
                for d in deps:
                    await d.start()
                made = [d.workspace for d in deps]
                try:
                    for i, d in enumerate(deps):
                        assert sorted(d.runtime.sessions) == ["default", "repl"]
                        assert (await sh(d.runtime, "echo $X; pwd")).output == "shared\n/repo\n"
                        obs = await sh(d.runtime, "print(n)", session="repl", is_interactive_command=True,
                                       expect=[">>> "], timeout=10)
                        assert obs.output == "41"
                        await d.runtime.write_file(WriteFileRequest(path="calc.py", content=FIXED if i else BUGGY))
                        r = await d.runtime.execute(Command(command="python3 test_calc.py", shell=True))
                        assert (r.exit_code, r.stdout) == ((0, "ok\n") if i else (1, ""))
                finally:
                    for d in deps:
                        await d.stop()
                assert all(w.closed for w in made) and not tpl.closed
            finally:
                tpl.close()
        finally:
            for k in kids:
                await k.stop()
            await dep.stop()
        assert all(k._runtime is None for k in kids)

    run(main())


def test_callers_workspace_stays_open(no_leaks):
    with bunshin.Workspace.create() as ws:
        dep = BunshinDeployment(workspace=ws)

        async def main():
            await dep.start()
            assert (await dep.runtime.execute(Command(command="echo $((6*7))", shell=True))).stdout == "42\n"
            await dep.stop()

        run(main())
        assert not ws.closed
    with pytest.raises(bunshin.rl.RolloutError, match="setup command 1 'exit 4' exited 4"):
        run(BunshinDeployment(setup=["true", "exit 4"]).start())


def test_minisweagent_swerex_environment_runs_on_it(no_leaks):
    """mini-swe-agent's SWE-ReX environment hard-wires swe-rex's DockerDeployment in its
    constructor; its every other method runs unchanged on a Bunshin deployment."""
    pytest.importorskip("minisweagent")
    import yaml
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.config import get_config_path
    from minisweagent.environments.extra.swerex_docker import (
        SwerexDockerEnvironment,
        SwerexDockerEnvironmentConfig,
    )
    from minisweagent.models.test_models import DeterministicModel, make_output

    class OnBunshin(SwerexDockerEnvironment):
        def __init__(self, deployment, **kwargs):  # the one method replaced: no Docker
            self.config = SwerexDockerEnvironmentConfig(image="bunshin", **kwargs)
            self.deployment = deployment

    dep = BunshinDeployment(workdir="/repo", setup=SETUP, env=ENV)
    asyncio.run(dep.start())
    try:
        env = OnBunshin(dep, cwd="/repo", timeout=5)
        out = env.execute({"command": "python3 test_calc.py"})
        assert out["returncode"] == 1 and "AssertionError: -1" in out["output"]
        out = env.execute({"command": "sleep 30"}, timeout=1)
        assert out["returncode"] == -1 and out["extra"]["exception_type"] == "CommandTimeoutError"

        # the SWE-bench config, which mini-swe-agent pairs with its SWE-ReX environments
        config = yaml.safe_load(get_config_path("swebench").read_text())
        commands = ["cat calc.py", "sed -i 's/a - b/a + b/' calc.py && python3 test_calc.py",
                    "git diff --stat", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff"]
        model = DeterministicModel(
            outputs=[make_output(f"THOUGHT: {i}\n\n```mswea_bash_command\n{c}\n```", [{"command": c}], cost=0.0)
                     for i, c in enumerate(commands)],
            observation_template=config["model"]["observation_template"])
        agent = DefaultAgent(model, env, **config["agent"])
        result = agent.run("make add() add")
        assert result["exit_status"] == "Submitted" and "+    return a + b" in result["submission"]
        assert dep.workspace.read_file("/repo/calc.py") == FIXED.encode()
        assert "<returncode>0</returncode>" in agent.messages[5]["content"]
    finally:
        asyncio.run(dep.stop())
