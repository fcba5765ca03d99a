"""Where a rollout's workspace comes from, one provider per engine mode.

* ``fresh``  — :class:`FreshProvider`: every rollout creates a workspace and replays the task's
  setup (today's one-container-per-rollout).
* ``criu``   — :class:`CriuProvider`: the setup runs once, the workspace is dumped with CRIU,
  and every rollout gets an independent CRIU restore of it.
* ``fork``/``bunshin`` — :class:`ForkProvider`: the setup runs once, the workspace is
  snapshotted, and every rollout runs on a live copy-on-write fork of the snapshot.

``prepare()`` does the once-per-group work, ``acquire(i)`` gives rollout ``i`` its workspace and
shell, ``close()`` releases what ``prepare`` made. Each records the seconds it spent.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from typing import TYPE_CHECKING

from ..cache.tools import BUILTIN_TOOLS, ToolContext, run_tool
from .types import RolloutError, Task

if TYPE_CHECKING:
    from ..runtime.shell import Shell
    from ..runtime.template import Template
    from ..runtime.workspace import Workspace

log = logging.getLogger("bunshin.rl")

__all__ = ["CriuProvider", "ForkProvider", "FreshProvider", "build", "provider", "rollout_shell", "setup_key",
           "with_rollout_shell"]

READY_TIMEOUT = 120.0


def setup_key(task: Task) -> bytes:
    """What ``task``'s set-up state depends on: two tasks with one key can share one template.

    The verifier, prompt, step limit and tools only act on a rollout; the verifier is also
    compared by identity (a lambda pickled per call is a new object every time)."""
    calls = b"\0".join(c.canonical for c in task.setup)
    about = json.dumps([str(task.rootfs) if task.rootfs is not None else None, task.workdir, task.ready,
                        task.memory_limit]).encode()
    return about + b"\0" + calls


def build(task: Task, hostname: str) -> tuple[Workspace, Shell]:
    """A new workspace with ``task``'s setup done and ``ready`` passing; its session shell."""
    from ..runtime.workspace import Workspace

    ws = Workspace.create(task.rootfs, memory_limit=task.memory_limit, workdir=task.workdir,
                          hostname=hostname)
    try:
        # the task's, else the rootfs image's WorkingDir, else /; the setup may be what fills it
        ws.exec(["mkdir", "-p", ws.config.workdir], cwd="/")
        sh = ws.shell()
        ctx = ToolContext(ws, lambda: sh)
        for n, call in enumerate(task.setup):
            r = run_tool(BUILTIN_TOOLS, ctx, call)
            if not r.ok:
                raise RolloutError(f"task {task.id!r}: setup step {n} {call.name}({call.args}) failed "
                                   f"with exit code {r.exit_code}: {r.output[-800:]!r}; fix the task's setup")
        if task.ready is not None:
            deadline = time.monotonic() + READY_TIMEOUT
            while not ws.run(task.ready).ok:
                if time.monotonic() > deadline:
                    raise RolloutError(f"task {task.id!r}: ready check {task.ready!r} still fails after "
                                       f"{READY_TIMEOUT:.0f} s of waiting; check the setup's server/REPL")
                time.sleep(0.02)
        return ws, sh
    except BaseException:
        ws.close()
        raise


SNAPSHOT_SETTLE_S = 5.0
"""How long a set-up state is retried while its snapshot is refused for something that passes by
itself (``ForkError.transient``: the ready check's connection still closing on the server side)."""


def set_up_template(task: Task, hostname: str = "base") -> Template:
    """``task``'s set-up state as a template: built (:func:`build`), snapshotted, the base closed
    (the template holds the state)."""
    from ..errors import ForkError

    base, _ = build(task, hostname)
    try:
        deadline = time.monotonic() + SNAPSHOT_SETTLE_S
        while True:
            try:
                return base.snapshot()
            except ForkError as e:
                if not e.transient or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)  # the refused snapshot left the base running: let it finish
    finally:
        base.close()


def rollout_shell(ws: Workspace, cwd: str | None) -> Shell:
    """The workspace's session shell carried over from the setup, else a new one in ``cwd``
    (None: the workspace's working directory)."""
    live = [s for s in ws.shells if s.alive]
    return live[0] if live else ws.shell(cwd=cwd)


def with_rollout_shell(ws: Workspace, cwd: str | None) -> tuple[Workspace, Shell]:
    """``ws`` and its :func:`rollout_shell`; ``ws`` is closed when that fails (a rollout's
    workspace that its caller never got)."""
    try:
        return ws, rollout_shell(ws, cwd)
    except BaseException:
        ws.close()
        raise


class FreshProvider:
    """A new workspace per rollout, setup replayed each time."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.setup_s = 0.0  # summed over rollouts (they overlap in time)

    def prepare(self) -> None:
        pass

    def acquire(self, i: int) -> tuple[Workspace, Shell]:
        t = time.monotonic()
        ws, sh = build(self.task, f"rollout-{i}")
        self.setup_s += time.monotonic() - t
        return ws, sh

    def close(self) -> None:
        pass


class ForkProvider:
    """Setup once, snapshot, one live fork of the snapshot per rollout."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.setup_s = 0.0
        self.tpl: Template | None = None

    def prepare(self) -> None:
        t = time.monotonic()
        self.tpl = set_up_template(self.task)
        self.setup_s = time.monotonic() - t

    def acquire(self, i: int) -> tuple[Workspace, Shell]:
        assert self.tpl is not None, "prepare() first"
        return with_rollout_shell(self.tpl.fork(1)[0], self.task.workdir)

    def close(self) -> None:
        if self.tpl is not None:
            self.tpl.close()
            self.tpl = None


class CriuProvider:
    """Setup once, CRIU dump, one independent CRIU restore per rollout (``ksm``: with the
    restored processes' memory marked mergeable, the best stock setup)."""

    def __init__(self, task: Task, *, ksm: bool = False) -> None:
        from ..criu_locate import require_criu

        require_criu()  # CriuError, saying how to provision one, before any work
        self.task = task
        self.ksm = ksm
        self.setup_s = 0.0
        self.dump_s = 0.0
        self.images: str | None = None

    def prepare(self) -> None:
        from .. import criu

        t = time.monotonic()
        base, _ = build(self.task, "base")
        try:
            self.setup_s = time.monotonic() - t
            self.images = tempfile.mkdtemp(prefix="bunshin-rl-criu-")
            t = time.monotonic()
            criu.dump_workspace(base, self.images)
            self.dump_s = time.monotonic() - t
        finally:
            base.close()

    def acquire(self, i: int) -> tuple[Workspace, Shell]:
        from .. import criu

        assert self.images is not None, "prepare() first"
        return with_rollout_shell(criu.restore_workspace(self.images, ksm=self.ksm), self.task.workdir)

    def close(self) -> None:
        if self.images is not None:
            shutil.rmtree(self.images, ignore_errors=True)
            self.images = None


def provider(mode: str, task: Task, *, ksm: bool = False) -> FreshProvider | ForkProvider | CriuProvider:
    """The provider behind engine mode ``mode``."""
    if mode == "fresh":
        return FreshProvider(task)
    if mode == "criu":
        return CriuProvider(task, ksm=ksm)
    return ForkProvider(task)
