"""The Workload record, the download cache, and helpers the workloads share."""

from __future__ import annotations

import base64
import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bunshin.cache.toolcall import ToolCall
from bunshin.rl import Task

__all__ = ["Workload", "bash", "cache_dir", "fetch", "join_members", "member_rng", "py", "read",
           "stage_files", "write"]


@dataclass
class Workload:
    """A task, one trace per group member, every parameter stated, and per-step expectations.

    ``expect[i][j]``: the exit code step ``j`` of trace ``i`` must give on a correct workspace
    (None: not checked). ``traces`` has exactly ``group_size`` entries.
    """

    task: Task
    traces: list[list[ToolCall]]
    params: dict
    expect: list[list[int | None]] = field(default_factory=list)

    @property
    def shared_prefix(self) -> int:
        return int(self.params.get("shared_prefix_steps", 0))


def bash(command: str) -> ToolCall:
    return ToolCall("bash", {"command": command})


def py(code: str) -> ToolCall:
    return ToolCall("python", {"code": code})


def read(path: str) -> ToolCall:
    return ToolCall("read_file", {"path": path})


def write(path: str, content: str) -> ToolCall:
    return ToolCall("write_file", {"path": path, "content": content})


def join_members(shared: list[ToolCall], members: list[tuple[list[tuple[ToolCall, int | None]], dict]]
                 ) -> tuple[list[list[ToolCall]], list[list[int | None]], dict]:
    """Each member's trace: the ``shared`` calls (expected to exit 0), then its own ``(call,
    expected exit code)`` steps. ``members`` pairs those steps with what the member was dealt.
    Returns the traces, their expectations, and the parameters every workload states about
    them (prefix, divergence, lengths, members)."""
    traces, expect, chosen = [], [], []
    for i, (steps, info) in enumerate(members):
        traces.append(shared + [c for c, _ in steps])
        expect.append([0] * len(shared) + [e for _, e in steps])
        chosen.append({"member": i, **info, "steps": len(traces[-1])})
    lens = [len(t) for t in traces]
    return traces, expect, {
        "shared_prefix_steps": len(shared),
        "divergence_step": len(shared),
        "steps_per_trace": {"min": min(lens), "max": max(lens), "mean": sum(lens) / len(lens)},
        "members": chosen,
    }


def member_rng(seed: int, name: str) -> random.Random:
    """A deterministic RNG for one workload and seed (str seeds hash stably)."""
    return random.Random(f"bunshin-workload:{name}:{seed}")


def cache_dir() -> Path:
    """Where downloaded sdists and wheels are kept (``$BUNSHIN_WORKLOAD_CACHE`` or
    ``~/.cache/bunshin/workloads``)."""
    d = os.environ.get("BUNSHIN_WORKLOAD_CACHE")
    p = Path(d) if d else Path.home() / ".cache" / "bunshin" / "workloads"
    p.mkdir(parents=True, exist_ok=True)
    return p


def fetch(requirement: str, filename: str, *, sdist: bool) -> Path:
    """The file ``filename`` of ``requirement`` (``name==version``) from the cache, downloaded
    with ``pip download --no-deps`` (``--no-binary :all:`` for an sdist, else the pure-Python
    wheel) when missing. Raises RuntimeError naming the file if offline and not cached."""
    d = cache_dir()
    path = d / filename
    if path.is_file() and path.stat().st_size > 0:
        return path
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-d", str(d), requirement]
    cmd += ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        err = p.stderr.strip().splitlines()[-3:] if p.returncode else []
    except (OSError, subprocess.TimeoutExpired) as e:
        err = [str(e)]
    if not path.is_file():
        raise RuntimeError(
            f"workload source {filename} ({requirement}) is not in {d} and `pip download` "
            f"could not fetch it (offline? no PyPI access?): {' | '.join(err) or 'no file produced'}. "
            f"Download it on a connected machine with: {' '.join(cmd)}")
    return path


def stage_files(files: list[Path], dest: str) -> list[ToolCall]:
    """Setup calls that put ``files`` (bytes) into the workspace under ``dest``: one
    ``write_file`` of the base64 text per file, then one bash step decoding them all. Works on
    any rootfs (no host path needs to be visible inside the workspace)."""
    calls = [write(f"{dest}/{f.name}.b64", base64.b64encode(f.read_bytes()).decode("ascii"))
             for f in files]
    calls.append(bash(f"(cd {dest} && for f in *.b64; do base64 -d \"$f\" > \"${{f%.b64}}\" "
                      f"&& rm \"$f\" || exit 1; done) && ls {dest}"))
    return calls
