"""Templates: a workspace frozen at one moment, forkable many times.

Snapshotting a workspace freezes its processes in place (cgroup freezer); they become the
template and its upper layer becomes a read-only lower layer of every child. The workspace
itself continues as a fresh fork of the template (same PIDs, so the agent notices nothing).
Fork cost therefore does not grow with the files the workspace wrote. A template lives while
its handle or any child created from it does (its layer is under them).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Callable, Sequence

from ..errors import BunshinError, ForkError, WorkspaceClosed
from . import engine, nspool, seize, slots
from ..runtime.reap import reap_init, wait_exit_pidfd
from .resources import sysv_shm
from .plan import plan_tree

if TYPE_CHECKING:
    from ..runtime.workspace import Workspace

log = logging.getLogger("bunshin.fork")

__all__ = ["Template"]


class TemplateCore(slots.Holder):
    """The frozen processes, cgroup and layers behind a Template; reference counted."""

    def __init__(self, parts: dict, plans, shells: list[tuple[int, int, str]], config: dict) -> None:
        self.parts = parts  # dir, cg, init_pid, pidfd, init_is_child, chan, root_fd, rootfs, template
        self.plans = plans
        self.shells = shells  # (pty index, bash pid, nonce) of the source's shell sessions
        self.masters: list[int] = []  # the source's pty masters: the frozen shells' terminals
        self.config = config  # env, workdir, max_output, limits, run_shell
        self.lowers = (parts["dir"].upper, *parts["rootfs"].lowers)
        self.sysv_segments = sysv_shm.segments(parts["init_pid"])
        self.id = parts["dir"].id
        self.lock = threading.Lock()
        self.refs = 1
        self.closed = False
        self.slots: list[slots.Slot] = []  # host-side parts of the next children (slots.py)
        self.slots_closed = False
        self.spares: slots.Spares | None = None  # the snapshotted workspace's, for a first fork
        self.child_rootfs = None  # every child's ws.rootfs (runtime/forking.py makes it once)
        self._depth_ok = False
        self.reap_due = False  # whether a child may have exited since the last reap
        self._tmp_pid = engine.pid_max() - 1
        used = {p.vpid for p in plans}
        while self._tmp_pid in used:
            self._tmp_pid -= 1

    def acquire(self) -> None:
        with self.lock:
            if self.closed:
                raise WorkspaceClosed(f"template {self.id} is closed")
            self.refs += 1

    def release(self) -> None:
        with self.lock:
            self.reap_due = True  # a child closing: its init is now a zombie of ours
            self.refs -= 1
            if self.refs > 0 or self.closed:
                return
            self.closed = True
        self._destroy()

    def make_slot(self) -> "slots.Slot":
        return slots.make(self)

    def _taking(self) -> bool:
        return not (self.slots_closed or self.closed)

    def _destroy(self) -> None:
        p = self.parts
        p["chan"].close()
        for m in self.masters:
            os.close(m)
        try:
            p["cg"].kill_all()
        except BunshinError as e:
            log.warning("template %s: %s", self.id, e)
        if p["pidfd"] >= 0:  # frozen: no shutdown to wait for
            reap_init(p["pidfd"], is_child=p["init_is_child"], grace=0)
        if p["root_fd"] >= 0:
            os.close(p["root_fd"])
        p["cg"].destroy()
        p["dir"].remove()
        parent = p.get("template")
        if parent is not None:
            parent.release()

    # -- forking --------------------------------------------------------------------------
    def fork(self, n: int, on_fork: Callable[["Workspace"], None] | None = None,
             hostnames: Sequence[str] | None = None) -> list["Workspace"]:
        """``n`` new workspaces, each a copy-on-write clone of the template."""

        kids: list[Workspace] = []
        failed: BaseException | None = None
        with self.lock:
            if self.closed:
                raise WorkspaceClosed(f"template {self.id} is closed")
            p = self.parts
            if not self._depth_ok:  # the template's nesting never changes: check once
                engine.check_depth(p["init_pid"])
                self._depth_ok = True
            tracees = seize.seize_all(p["cg"], self.plans)
            pin = None
            try:
                pin = seize.Pinned(tracees)
                if self.reap_due:  # an injected wait4 loop: only when a child went
                    self.reap_due = False
                    seize.reap_children(tracees[p["init_pid"]])
                self._fork_many(tracees, pin, on_fork,
                                [hostnames[i] if hostnames else None for i in range(n)], kids)
            except BaseException as e:
                failed = e
                self.reap_due = True  # the inits of the children it removed
            finally:
                if pin is not None:
                    pin.restore()
                seize.release_all(p["cg"], tracees)
                pool = nspool.pool()
                if pool is not None:
                    pool.refill()
        if failed is not None:
            for k in kids:  # outside the lock: closing a child releases our reference
                k.close()
            raise failed
        return kids

    def _fork_many(self, tracees, pin, on_fork, hostnames: list[str | None],
                   done: list["Workspace"]) -> None:
        """Every child's init first, then each template process cloned into all the children
        at once (one FORK call with the module), then each child finished and handed out
        into ``done``. On failure the children not yet handed out are removed completely; the
        ones in ``done`` (``on_fork`` run, running) are the caller's to close."""
        start = time.perf_counter()
        kids: list[_Child] = []
        try:
            for host in hostnames:
                kids.append(_Child(self, tracees, pin, host))
            for pl in self.plans[1:]:
                clones = engine.clone_process(tracees[pl.hostpid], pl, [k.ci.pid for k in kids],
                                              self._tmp_pid)
                for k, c in zip(kids, clones):
                    k.clones.append(c)
                for k, c in zip(kids, clones):
                    k.ready()
                    k.fix(pl, c)
            for k in kids:
                k.finish()
            while kids:
                done.append(kids[0].hand_out(on_fork))
                kids.pop(0)
        except BaseException:
            for k in kids:
                k.abort()
            raise
        done_ms = (time.perf_counter() - start) * 1e3
        for ws in done:
            log.info("forked %s from template %s in %.2f ms (%d at once, %d processes)",
                     ws.id, self.id, done_ms, len(hostnames), len(self.plans))


class _Child:
    """One child of a fork call while it is being made: its slot, init and clones, and how
    to remove all of it."""

    def __init__(self, core: TemplateCore, tracees, pin, hostname: str | None) -> None:
        self.core, self.tracees, self.pin = core, tracees, pin
        self.clones: list = []
        self.ci = self.chan = self.ws = self.ctx = None
        self.pidfd = -1
        slot = core.slots.pop() if core.slots else None  # core.lock is held by fork()
        if slot is None:  # none made ahead: the same pieces, now (make() cleans up its own)
            try:
                slot = slots.make(core)
            except OSError as e:
                raise ForkError(f"cannot create the child's directory: {e}") from None
        self.d, self.cg, mfd = slot.dir, slot.cg, slot.mount_fd
        self.host = hostname or core.config["hostname"]
        try:
            self.ci, sock = engine.clone_init(tracees[core.parts["init_pid"]], core.parts["chan"]._sock,
                                              mfd, self.host, self.cg, pin)
            self.pidfd = os.pidfd_open(self.ci.pid)
            from ..runtime.channel import Channel

            self.chan = Channel(sock, f"workspace {self.d.id}")
        except BaseException:
            self.abort()
            raise
        finally:
            if mfd >= 0:
                os.close(mfd)

    def ready(self) -> None:
        """Wait for the init to be in its root (it moves there while the first clones are
        made), then give it what the clones' fixups expect: /dev/shm and SysV segments."""
        if self.ctx is not None:
            return
        core = self.core
        self.chan.wait_ready(10)
        self.pin.release_clone(core.parts["init_pid"], self.ci)
        engine.copy_dev_shm(core.parts["init_pid"], self.ci.pid)
        sysv_shm.copy_segments(core.parts["init_pid"], self.ci.pid, core.sysv_segments)
        self.ctx = engine.ForkCtx(init_hostpid=self.ci.pid, plans={pl.vpid: pl for pl in core.plans},
                                  shared={"tracees": self.tracees, "template-upper": str(core.lowers[0])})

    def fix(self, pl, c) -> None:
        engine.fix_process(self.ctx, pl, c)
        self.pin.release_clone(pl.hostpid, c)
        self.cg.add(c.pid)

    def finish(self) -> None:
        from ..runtime.workspace import Workspace

        self.ready()  # a workspace of its init alone has had no fixup to wait for it
        core = self.core
        engine.reparent_clones(core.plans, {pl.vpid: c for pl, c in zip(core.plans[1:], self.clones)})
        engine.finish_child(self.ctx)
        masters = self.ctx.shared.get("pty_masters", {})
        self.ws = Workspace._from_fork(core, self.d, self.cg, self.ci.pid, self.pidfd, self.chan,
                                       masters, self.host)
        core.refs += 1  # core.lock is held by fork()
        self.pidfd, self.chan, self.cg = -1, None, None  # owned by ws now

    def hand_out(self, on_fork) -> "Workspace":
        """``on_fork``, then let the clones run: the workspace is the caller's."""
        if on_fork is not None:
            on_fork(self.ws)
        for c in self.clones:
            c.detach()
        self.clones = []
        ws, self.ws = self.ws, None
        return ws

    def abort(self) -> None:
        """Remove everything this child made (safe at any point, and twice)."""
        for c in self.clones:
            engine.discard_clone(c)
        self.clones = []
        if self.ws is not None:  # finished: the workspace owns the rest
            ws, self.ws = self.ws, None
            ws._template = None  # we hold the lock: give the reference back by hand
            self.core.refs -= 1
            ws.close()
            return
        if self.chan is not None:
            self.chan.close()  # the child's init sees EOF and takes its namespace down
            self.chan = None
        if self.ci is not None:
            os.kill(self.ci.pid, 9)
            if self.pidfd >= 0:
                wait_exit_pidfd(self.pidfd, 5)
            self.ci = None
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        if self.cg is not None:
            self.cg.destroy()
            self.cg = None
        if self.d is not None:
            self.d.remove()
            self.d = None


def snapshot_parts(parts: dict, config: dict, shells: list[tuple[int, int, str]]) -> TemplateCore:
    """Freeze a workspace's processes and plan their fork; on failure thaw and raise."""
    cg = parts["cg"]
    cg.freeze()
    try:
        return TemplateCore(parts, plan_tree(cg.pids()), shells, config)
    except BaseException:
        cg.thaw()
        raise


class Template:
    """A frozen workspace state. ``fork(n)`` makes live copies; ``close()`` when done.

    Children outlive the handle: the frozen state is kept until the last child closes.
    """

    def __init__(self, core: TemplateCore) -> None:
        self._core = core
        self._closed = False

    @property
    def id(self) -> str:
        return self._core.id

    def fork(self, n: int = 1, on_fork: Callable[["Workspace"], None] | None = None) -> list["Workspace"]:
        """``n`` live workspaces in the template's state (memory shared copy-on-write).
        ``on_fork(child)`` runs once per child before its processes resume."""
        if self._closed:
            raise WorkspaceClosed(f"template {self.id} is closed")
        _check_n(n)
        kids = self._core.fork(n, on_fork)
        slots.request(self._core, n)  # the next call's host-side parts, made meanwhile
        return kids

    def save(self, path: str | os.PathLike) -> None:
        """Write this frozen state to ``path`` (a new or empty directory) with CRIU; see
        :mod:`bunshin.criu`. The template is left as it was."""
        if self._closed:
            raise WorkspaceClosed(f"template {self.id} is closed")
        from .. import criu

        criu.save(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Template":
        """A frozen template restored from images written by :meth:`save` (or
        ``bunshin.criu.dump_workspace``); fork it as any other."""
        from .. import criu

        return criu.load(path)

    def host_pids(self) -> list[int]:
        """Host pids of the template's frozen processes (for accounting)."""
        return [pl.hostpid for pl in self._core.plans]

    def close(self) -> None:
        """Drop this handle; the frozen processes go when no child needs them."""
        if not self._closed:
            self._closed = True
            self._core.close_slots()
            self._core.release()

    def __enter__(self) -> "Template":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Template {self.id} {len(self._core.plans)} processes{' closed' if self._closed else ''}>"


def _check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ForkError(f"n must be an int ≥ 1 (how many children), got {n!r}")
