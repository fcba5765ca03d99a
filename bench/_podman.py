"""Real containers as the end-to-end baseline: the group run in podman (with runc) instead of Bunshin.

Two modes, each the container counterpart of a Bunshin one:

* ``podman``            — a new container per rollout, the task's setup replayed in it (``fresh``);
* ``podman-checkpoint`` — setup once in a container, ``podman container checkpoint --export``
  (CRIU), one ``podman container restore --import`` per rollout (``criu``).

The image is the same root filesystem the Bunshin modes run on, imported with ``podman import``
(no registry). Every tool call is one ``podman exec`` (``bash -c``, ``python3 -c``, ``cat``, and
``cat >`` for a write); the working directory is the task's. Memory is sampled by the same
:class:`bunshin.rl.metrics.MemorySampler` as the other modes, over the processes of each
container's cgroup and its ``conmon`` (each page counted once); the ``podman`` CLI processes on
the host are not counted, as the trainer is not counted for Bunshin. Containers run with
``--network none`` (the workloads use loopback only) and the ulimits this machine's hard limits
allow; a restored container's loopback, which podman 4.3.1 leaves down, is brought up (counted in
the restore); containers and the image are removed when the mode ends.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from bunshin.rl.engine import GroupResult, _observation
from bunshin.rl.metrics import CpuMeter, MemorySampler
from bunshin.rl.types import Final, History, Trajectory, Turn
from bunshin.runtime.result import Result

MODES = ("podman", "podman-checkpoint")
RUNTIME = "runc"  # crun refuses this machine's hybrid cgroup layout
# podman's defaults (nofile 1048576, nproc 4194304) exceed this machine's hard limits
ULIMITS = ("--ulimit", "nofile=20000:20000", "--ulimit", "nproc=4096:4096")
READY_TIMEOUT = 120.0
TOOL_TIMEOUT = 30.0


class PodmanError(RuntimeError):
    pass


def why_not(criu: str | None, mode: str) -> str | None:
    """Why ``mode`` cannot run here (None: it can)."""
    if shutil.which("podman") is None:
        return "podman is not installed (apt-get install podman runc)"
    if shutil.which(RUNTIME) is None:
        return f"{RUNTIME} is not installed (apt-get install runc)"
    try:
        p = subprocess.run(["podman", "--runtime", RUNTIME, "info", "--format", "{{.Host.OCIRuntime.Name}}"],
                           capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"podman info failed: {e}"
    if p.returncode != 0:
        return f"podman info failed: {p.stderr.strip()[-300:]}"
    if mode == "podman-checkpoint" and criu is None:
        return "no CRIU ≥ 4 found for podman's checkpoint (bunshin criu provision)"
    return None


class Podman:
    """The podman CLI with runc, pointed at ``criu`` (podman checks the version of the criu on
    PATH; runc runs the one ``--runtime-flag criu=`` names)."""

    def __init__(self, criu: str | None = None) -> None:
        self.argv = ["podman", "--runtime", RUNTIME]
        self.env = dict(os.environ)
        if criu is not None:
            self.argv += ["--runtime-flag", f"criu={criu}"]
            self.env["PATH"] = f"{Path(criu).parent}:{self.env.get('PATH', '')}"

    def __call__(self, *args: str, input: bytes | None = None, timeout: float = 600) -> str:
        p = subprocess.run([*self.argv, *args], input=input, capture_output=True, env=self.env,
                           timeout=timeout, check=False)
        if p.returncode != 0:
            raise PodmanError(f"podman {' '.join(args[:3])}: exit {p.returncode}: "
                              f"{p.stderr.decode(errors='replace').strip()[-600:]}")
        return p.stdout.decode(errors="replace")

    async def acall(self, *args: str, input: bytes | None = None,
                    timeout: float = 600) -> tuple[int, bytes, bytes]:
        proc = await asyncio.create_subprocess_exec(
            *self.argv, *args, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env)
        try:
            out, err = await asyncio.wait_for(proc.communicate(input), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise PodmanError(f"podman {' '.join(args[:3])}: no answer in {timeout:.0f} s") from None
        assert proc.returncode is not None
        return proc.returncode, out, err

    async def acheck(self, *args: str) -> str:
        rc, out, err = await self.acall(*args)
        if rc != 0:
            raise PodmanError(f"podman {' '.join(args[:3])}: exit {rc}: {err.decode(errors='replace').strip()[-600:]}")
        return out.decode(errors="replace")


class Image:
    """A root directory imported as a podman image (``podman import``), removed on close."""

    def __init__(self, pod: Podman, root: Path, tag: str) -> None:
        self.pod, self.tag = pod, tag
        tar = subprocess.Popen(["tar", "-C", str(root), "--numeric-owner", "-cf", "-", "."],
                               stdout=subprocess.PIPE)
        try:
            assert tar.stdout is not None
            p = subprocess.run([*pod.argv, "import", "-", tag], stdin=tar.stdout, capture_output=True,
                               env=pod.env, timeout=600, check=False)
        finally:
            if tar.stdout is not None:
                tar.stdout.close()
            tar.wait()
        if p.returncode != 0 or tar.returncode != 0:
            raise PodmanError(f"podman import of {root}: exit {p.returncode}: "
                              f"{p.stderr.decode(errors='replace')[-600:]}")

    def close(self) -> None:
        subprocess.run([*self.pod.argv, "rmi", "-f", self.tag], capture_output=True, env=self.pod.env,
                       timeout=120, check=False)


class Containers:
    """The containers of one mode run: started, removed, and their host pids for the sampler."""

    def __init__(self, pod: Podman, prefix: str) -> None:
        self.pod, self.prefix = pod, prefix
        self._lock = threading.Lock()
        self._procs: dict[str, tuple[str, int]] = {}  # name -> (its cgroup.procs, its conmon's pid)
        self.names: set[str] = set()

    async def track(self, name: str) -> None:
        """Learn the cgroup of a started (or restored) container, and its conmon."""
        pid, conmon = (await self.pod.acheck("inspect", "--format", "{{.State.Pid}} {{.State.ConmonPid}}",
                                             name)).split()
        procs = None
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                _, ctrl, path = line.rstrip("\n").split(":", 2)
                if "memory" in ctrl.split(","):
                    procs = f"/sys/fs/cgroup/memory{path}/cgroup.procs"
        if procs is None:
            raise PodmanError(f"container {name}: its process {pid} is in no memory cgroup")
        with self._lock:
            # conmon's cgroup holds every container's conmon: only this one's pid is its
            self._procs[name] = (procs, int(conmon))

    def pids(self) -> dict[str, list[int]]:
        """``{container: host pids}`` now (the sampler's source)."""
        with self._lock:
            items = list(self._procs.items())
        out: dict[str, list[int]] = {}
        for name, (procs, conmon) in items:
            try:
                with open(procs) as f:
                    pids = [int(x) for x in f.read().split()]
            except OSError:
                pids = []
            if os.path.exists(f"/proc/{conmon}"):
                pids.append(conmon)
            out[name] = pids
        return out

    async def run(self, image: str, name: str) -> None:
        self.names.add(name)
        await self.pod.acheck("run", "-d", "--name", name, "--network", "none", *ULIMITS, image,
                              "sleep", "infinity")
        await self.track(name)

    async def restore(self, archive: str, name: str) -> None:
        self.names.add(name)
        await self.pod.acheck("container", "restore", "--import", archive, "--name", name)
        await self.track(name)
        # podman 4.3.1 restores a --network none container into a new network namespace with
        # its loopback down: the set-up servers' listening sockets would refuse every connection
        pid = (await self.pod.acheck("inspect", "--format", "{{.State.Pid}}", name)).strip()
        proc = await asyncio.create_subprocess_exec("nsenter", "-t", pid, "-n", "ip", "link", "set", "lo", "up",
                                                    stderr=subprocess.PIPE)
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise PodmanError(f"container {name}: cannot bring its loopback up: {err.decode(errors='replace')}")

    def forget(self, name: str) -> None:
        with self._lock:
            self._procs.pop(name, None)

    async def remove(self, name: str) -> None:
        self.forget(name)
        await self.pod.acall("rm", "-f", "-t", "0", name)
        self.names.discard(name)

    def remove_all(self) -> None:
        for name in list(self.names):
            self.forget(name)
            subprocess.run([*self.pod.argv, "rm", "-f", "-t", "0", name], capture_output=True,
                           env=self.pod.env, timeout=120, check=False)
        self.names.clear()


async def tool(pod: Podman, name: str, workdir: str, call) -> Result:
    """One tool call as one ``podman exec``."""
    t = time.monotonic()
    args, data = call.args, None
    if call.name == "bash":
        argv = ["bash", "-c", args["command"]]
    elif call.name == "python":
        argv = ["python3", "-c", args["code"]]
    elif call.name == "read_file":
        argv = ["cat", "--", args["path"]]
    elif call.name == "write_file":
        argv = ["sh", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1"', "sh", args["path"]]
        data = args["content"].encode()
    else:
        raise PodmanError(f"tool {call.name!r} has no podman counterpart")
    # bounded as a Bunshin tool call is (Workspace.run's default): killed inside the container,
    # the exec itself given a margin on top
    argv = ["timeout", "-s", "KILL", f"{TOOL_TIMEOUT:.0f}", *argv]
    rc, out, err = await pod.acall("exec", *(["-i"] if data is not None else []), "-w", workdir, name, *argv,
                                   input=data, timeout=TOOL_TIMEOUT + 60)
    return Result(out, err, rc, time.monotonic() - t)


async def setup(pod: Podman, name: str, task) -> None:
    """The task's setup and ready check in a started container."""
    await pod.acheck("exec", name, "mkdir", "-p", task.workdir)
    for n, call in enumerate(task.setup):
        r = await tool(pod, name, task.workdir, call)
        if not r.ok:
            raise PodmanError(f"setup step {n} {call.name} failed with exit {r.exit_code}: {r.output[-600:]!r}")
    if task.ready is not None:
        deadline = time.monotonic() + READY_TIMEOUT
        while (await tool(pod, name, task.workdir, _bash(task.ready))).exit_code != 0:
            if time.monotonic() > deadline:
                raise PodmanError(f"ready check {task.ready!r} still fails after {READY_TIMEOUT:.0f} s")
            await asyncio.sleep(0.02)


def _bash(command: str):
    from bunshin.cache.toolcall import ToolCall

    return ToolCall("bash", {"command": command})


async def _group(mode: str, pod: Podman, image: str, task, policy, group: int, on_turn,
                 sample_interval: float = 0.1) -> GroupResult:
    from bunshin.cache.toolcall import as_tool_call

    prefix = f"bunshin-e2e-{os.getpid()}-{mode}"
    ctrs = Containers(pod, prefix)
    sampler = MemorySampler(sample_interval, source=ctrs.pids, frozen=set)
    scratch = tempfile.mkdtemp(prefix="bunshin-e2e-podman-")
    archive = os.path.join(scratch, "checkpoint.tar")
    extra: dict = {}
    setup_s = 0.0
    cpu = CpuMeter().start()
    start = time.monotonic()
    sampler.start()
    try:
        if mode == "podman-checkpoint":
            base = f"{prefix}-base"
            await ctrs.run(image, base)
            await setup(pod, base, task)
            setup_s = time.monotonic() - start
            t = time.monotonic()
            await pod.acheck("container", "checkpoint", "--export", archive, base)
            extra["checkpoint_s"] = time.monotonic() - t
            extra["checkpoint_bytes"] = os.path.getsize(archive)
            await ctrs.remove(base)

        async def one(i: int) -> Trajectory:
            nonlocal setup_s
            t0 = time.monotonic()
            name = f"{prefix}-{i}"
            hist = History(task, i)
            final, error = None, None
            try:
                if mode == "podman":
                    await ctrs.run(image, name)
                    await setup(pod, name, task)
                    setup_s += time.monotonic() - t0
                else:
                    t = time.monotonic()
                    await ctrs.restore(archive, name)
                    extra.setdefault("restore_s", []).append(time.monotonic() - t)
                while len(hist.turns) < task.max_steps:
                    t = time.monotonic()
                    action = await policy.act(hist)
                    think = time.monotonic() - t
                    if isinstance(action, Final):
                        final = action
                        break
                    call = as_tool_call(action)
                    t = time.monotonic()
                    r = await tool(pod, name, task.workdir, call)
                    turn = Turn(call, _observation(r), r.exit_code, think_s=think, tool_s=time.monotonic() - t)
                    hist.turns.append(turn)
                    if on_turn is not None:
                        on_turn(i, turn)
            except Exception as e:  # noqa: BLE001 - one failed rollout must not end the group
                error = f"{type(e).__name__}: {e}"
            finally:
                await ctrs.remove(name)
            return Trajectory(task_id=task.id, index=i, mode=mode, turns=hist.turns, final=final,
                              start_s=t0, end_s=time.monotonic(), error=error)

        trajs = list(await asyncio.gather(*(one(i) for i in range(group))))
    finally:
        end = time.monotonic()
        mem = sampler.stop()
        await asyncio.get_running_loop().run_in_executor(None, ctrs.remove_all)
        shutil.rmtree(scratch, ignore_errors=True)
    if "restore_s" in extra:
        rs = sorted(extra.pop("restore_s"))
        extra["restore_p50_s"] = rs[len(rs) // 2]
    return GroupResult(mode=mode, task_id=task.id, trajectories=trajs, latency_s=end - start, setup_s=setup_s,
                       memory=mem, cpu=cpu.stop(), extra=extra)


def run_group(mode: str, image: str, task, policy, group: int, criu: str | None, on_turn=None) -> GroupResult:
    """One group of ``mode`` (see the module docstring) in containers of ``image``."""
    pod = Podman(criu if mode == "podman-checkpoint" else None)
    return asyncio.run(_group(mode, pod, image, task, policy, group, on_turn))


def image_tag() -> str:
    return f"localhost/bunshin-e2e-{os.getpid()}:latest"
