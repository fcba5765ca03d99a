"""Template cores: a workspace's body frozen at one moment, forkable many times.

A fork freezes its source workspace in place (cgroup freezer) and copies its upper layer
(runtime/layers.py: a btrfs snapshot); for the length of that fork its processes are the
template (a *source* core: the body stays the workspace's), the copy is the children's lower
layer, and then they are let go and thawed, the same tasks as before. ``ws.snapshot()`` makes
one such child and keeps it frozen, unrun: its processes are the template a Template handle
holds, and its own upper layer (never written again) is its children's lower layer. Fork
cost therefore does not grow with the files the workspace wrote. A template lives while its
handle or any child created from it does (its layers are under them); a source's pid
namespace holds its children's, so a source closed before them stays frozen until they go
(Body.hold).

Forks run in the fork engine's thread (keeper.py). While the handle is open, that thread keeps
the template's processes seized between forks, and clones the next children's inits into the
slots made ahead (earlyinit.py, slots.py), so a fork starts with its children's inits running.

A fork makes bodies (bunshin.runtime.body); the handle on each (a Workspace) is made by the
``build`` function the core was given when it was snapshotted (bunshin.runtime.workspace), and
the public Template handle is bunshin.runtime.template's.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Sequence

from ..errors import BunshinError, ForkError, WorkspaceClosed
from ..runtime import layers
from ..runtime.body import Body, SessionCopy, session_copies
from ..runtime.channel import Channel
from ..runtime.reap import wait_exit_pidfd
from ..runtime.rootfs.model import Rootfs
from ..runtime.statedir import Meta, own_start_time
from ..runtime.workspace_config import WorkspaceConfig
from . import cloners, earlyinit, engine, keeper, nspool, resources, seize, slots, tree
from .perprocess import PerProcess
from .resources import ptys, sysv_msg, sysv_sem, sysv_shm, threads
from .resources.sysv_ipc import ids as sysv_ids, in_ipc_ns
from .plan import Unsettled, plan_tree

if TYPE_CHECKING:
    from ..compel import Tracee
    from ..runtime.cgroup.base import Cgroup
    from ..runtime.statedir import WorkspaceDir

log = logging.getLogger("bunshin.fork")

__all__ = ["Build", "TemplateCore", "check_n", "freeze_source", "snapshot_body"]

#: What makes the handle on a forked body (a Workspace): given the core's config, the body
#: and its copies of the source's shell sessions, in the source's order.
Build = Callable[[WorkspaceConfig, Body, "list[SessionCopy]"], Any]

# Where the template's init cannot be made to ignore SIGCHLD (seize.ignore_children), the
# inits of closed children stay its zombies until a fork reaps them inside it; a reap costs a
# stop of that init (~20 us per call, one batch for all), so forks reap only once this many
# children have closed (a zombie holds a pid and little else).
REAP_AT = 8


class TemplateCore(slots.Holder):
    """The frozen processes, cgroup and layers behind a Template; reference counted."""

    def __init__(self, body: Body, plans: list | None, shells: list[tuple[int, int, str]],
                 config: WorkspaceConfig, build: Build, frozen_upper: Path | None = None,
                 sysv: tuple | None = None) -> None:
        """``plans`` None: read when first needed (see :attr:`plans`)."""
        self.body = body  # frozen: its processes are the template
        # a copy of the running workspace's upper layer taken at the freeze: a source core's
        self.frozen_upper = frozen_upper
        self._plans: list | None = None
        self._plan_lock = threading.Lock()
        self.shells = shells  # (pty index, bash pid, session id) of the source's shell sessions
        self.masters: list[int] = []  # the source's pty masters: the frozen shells' terminals
        self.config = config
        self.build = build
        # the upper layer as it was at the freeze (a frozen template never writes again), if
        # anything was written there: an empty layer is left out of the children's stack
        own = frozen_upper / "upper" if frozen_upper is not None else body.dir.upper
        self.lowers = _child_lowers(own, body)
        self.own_upper: Path | None = own if self.lowers[:1] == (own,) else None
        self._sysv: tuple | None = None  # (segments, sets, queues), with the plan (_set_plans)
        self.id = body.id
        assert body.channel is not None  # a snapshot is of a running body
        self.ctl_sock = body.channel.sock  # the trainer's end of its init's control socket
        self.lock = threading.Lock()
        self.refs = 1
        self.closed = False
        self.slots: list[slots.Slot] = []  # host-side parts of the next children (slots.py)
        self.slots_closed = False
        self.spares: slots.Spares | None = None  # the snapshotted workspace's, for a first fork
        self._child_rootfs: Rootfs | None = None
        self._depth_ok = False
        self.dev_shm_used: bool | None = None  # its /dev/shm is not empty (asked at a first fork)
        self.reap_due = 0  # children closed (or removed by a failed fork) since the last reap
        # the init ignores SIGCHLD (set at the first seize): the kernel reaps its children;
        # None until that seize asked (asked once: one that refused is not asked again)
        # A source's init runs on and reaps its children itself: it keeps its SIGCHLD.
        self.autoreap: bool | None = False if self.source else None
        self._trainer_ptys: set[int] | None = None
        # while a Template handle is open, the engine's thread keeps the processes seized
        # between forks (keeper.py): their Tracees and CPU pin, and the trainer that holds them
        self.held: dict | None = None
        self.pin: seize.Pinned | None = None
        self.held_by = 0
        # held and thawed (still ptrace-stopped): a fork refreezes only once the engine is idle
        self.awake = False
        # a source's: when it was frozen (its own blocked calls count down from then when it is
        # let go), None: not known
        self.frozen_at: float | None = None
        # each template process's intermediates (engine.make_mid) take a pid of their own in
        # the child's namespace, unused by the template's, as several may live at once
        self.tmp_pids: dict[int, int] = {}
        if plans is not None:
            self._set_plans(plans, sysv)

    def _set_plans(self, plans: list, sysv: tuple | None) -> None:
        """The plan and what comes with it: the SysV objects (read with the plan, or now) and
        the intermediates' pids."""
        self._sysv = sysv if sysv is not None else sysv_objects(self.body.init_pid, plans)
        used, tmp = {p.vpid for p in plans}, engine.pid_max()
        for pl in plans[1:]:
            tmp -= 1
            while tmp in used:
                tmp -= 1
            self.tmp_pids[pl.hostpid] = tmp
        self._plans = plans

    @property
    def plans(self) -> list:
        """The template's processes, as plan.py reads them. A snapshot's (an unrun fork's,
        frozen for good) are read when first needed: by its first fork, or in the fork thread's
        idle time before (plan_idle), not while ``ws.snapshot()`` is waited for; what the plan
        refuses is then refused by that fork, before anything is made."""
        if self._plans is None:
            with self._plan_lock:
                if self._plans is None:
                    self._set_plans(_plan_settled(self.body.cgroup), None)
        assert self._plans is not None
        return self._plans

    @property
    def sysv(self) -> tuple[list, sysv_sem.Sets, sysv_msg.Queues]:
        """The template's SysV segments, semaphore sets and message queues (read with its plan)."""
        _ = self.plans
        assert self._sysv is not None
        return self._sysv

    def plan_idle(self) -> None:
        """Idle work of the fork thread: the plan, ahead of the first fork."""
        if self.closed:
            return
        try:
            self.plans  # noqa: B018 - read, kept
        except Exception as e:  # noqa: BLE001 - the first fork plans again, and says why
            log.debug("template %s: planning ahead of its first fork: %s", self.id, e)

    @property
    def source(self) -> bool:
        """A running workspace's processes, for one fork: it lets them go, thawed, and the
        body stays the workspace's."""
        return self.frozen_upper is not None

    def child_rootfs(self) -> Rootfs:
        """What each child's ``ws.rootfs`` says: made (and its layers checked, ~0.3 ms) once,
        as the template's layers never change."""
        if self._child_rootfs is None:
            self._child_rootfs = Rootfs(lowers=tuple(self.lowers), kind="fork",
                                        source=f"fork of {self.id}")
        return self._child_rootfs

    def child_meta(self, d, cg, init_pid: int) -> Meta:
        """What a child's meta file says (written at the fork, or ahead with its init)."""
        return Meta(id=d.id, owner_pid=os.getpid(), owner_start=own_start_time(), init_pid=init_pid,
                    cgroup=cg.name, rootfs=self.child_rootfs().source,
                    lowers=[str(p) for p in self.lowers], parent=self.id)

    def trainer_ptys(self) -> set[int]:
        """Indexes of the ptys whose masters a child's Workspace holds (its shell sessions')."""
        if self._trainer_ptys is None:
            self._trainer_ptys = ptys.trainer_indexes(self.plans)
        return self._trainer_ptys

    def acquire(self) -> None:
        with self.lock:
            if self.closed:
                raise WorkspaceClosed(f"template {self.id} is closed")
            self.refs += 1

    def release(self) -> None:
        with self.lock:
            self.child_init_gone()
            self.refs -= 1
            if self.refs > 0 or self.closed:
                return
            self.closed = True
        self._destroy()

    def child_init_gone(self, n: int = 1) -> None:
        """``n`` children's inits end (closed, or removed by a failed fork): zombies of our
        init to reap, unless the kernel does."""
        if not self.autoreap:
            self.reap_due += n

    def mids_reap_themselves(self, pl) -> bool:
        """Whether the intermediates of ``pl``'s clones can be its siblings (engine.make_mid):
        children of the template's init, which ignores SIGCHLD. Its own children only, and
        only with their usual exit signal (the one a sibling's death sends)."""
        return bool(self.autoreap) and pl.ppid == 1 and pl.exit_signal == signal.SIGCHLD

    def make_slot(self) -> slots.Slot:
        return slots.make(self)

    def add_slot(self, s) -> bool:
        if not super().add_slot(s):
            return False
        if self.held is not None and earlyinit.enabled():
            keeper.fork_thread().post(self._early_inits)
        return True

    def _early_inits(self) -> None:
        """Idle work of the engine's thread: the child's init cloned into each slot that has
        none, while the template is held (earlyinit.py); the next fork finds it running."""
        with self.lock:
            if self.held is None or self.pin is None or not self._taking():
                return
            todo = [s for s in self.slots if s.early is None and s.mount_fd >= 0]
            if not todo:
                return
            tinit = self.held[self.body.init_pid]  # thaws the template (_Waking): the clones run in it
            self.pin.repin_engine()
            try:
                fit = earlyinit.mids_fit(self)
                for s in todo:
                    s.early = earlyinit.clone_into(s, tinit, self.ctl_sock, self.config.hostname,
                                                   self.pin)
                    if fit:
                        earlyinit.make_mids(s.early, self, self.held, s.cg)
            except BaseException as e:  # noqa: BLE001 - the fork clones its init itself
                log.warning("template %s: cloning a child's init ahead: %s", self.id, e)
                self._let_go_locked()  # whatever state the template is in, a fork starts clean
                return
            finally:
                if self.held is not None:
                    self._doze()
            pool = nspool.pool()
            if pool is not None:  # the inits took their net/ipc/uts namespaces from it
                pool.refill()
            for s in todo:
                assert s.early is not None  # cloned into each above (or we returned), under the lock
                try:
                    earlyinit.settle(s.early, self, s, self.pin)
                except (BunshinError, OSError) as e:
                    log.warning("template %s: a child's init made ahead: %s", self.id, e)

    def _taking(self) -> bool:
        return not (self.slots_closed or self.closed)

    def _destroy(self) -> None:
        self.let_go()  # a Template handle closing did; at exit, or after a failure, maybe not
        for m in self.masters:
            os.close(m)
        if self.frozen_upper is not None:
            self.body.unhold(self.frozen_upper)
        else:
            self.body.close(frozen=True)

    # -- forking --------------------------------------------------------------------------
    def fork(self, n: int, on_fork: Callable[[Any], None] | None = None,
             hostnames: Sequence[str] | None = None, keep: bool = False, unrun: bool = False) -> list:
        """``n`` new workspaces (what ``build`` makes of each child's body), each a
        copy-on-write clone of the template, made in the fork engine's thread. ``keep``: leave
        the template's processes seized by that thread for the next fork (until
        :meth:`let_go`). ``unrun``: leave the children's processes frozen, never run (to be
        a template themselves)."""
        return keeper.fork_thread().run(self._fork, n, on_fork, hostnames, keep, unrun, abandon=_close_all)

    def _fork(self, n: int, on_fork, hostnames: Sequence[str] | None, keep: bool, unrun: bool) -> list:
        kids: list = []
        failed: BaseException | None = None
        with self.lock:
            if self.closed:
                raise WorkspaceClosed(f"template {self.id} is closed")
            if not self._depth_ok:  # the template's nesting never changes: check once
                engine.check_depth(self.body.init_pid)
                self._depth_ok = True
            self.plans  # noqa: B018 - read now if not yet: refusals come before anything is made
            tracees, pin = self._stop()
            try:
                if self.reap_due >= REAP_AT:
                    self.reap_due -= seize.reap_children(tracees[self.body.init_pid], self.reap_due)
                    self.reap_due = max(self.reap_due, 0)
                self._fork_many(tracees, pin, on_fork,
                                [hostnames[i] if hostnames else None for i in range(n)], kids, unrun)
            except BaseException as e:
                failed = e
                self.child_init_gone(n)  # the inits of the children it removed
            finally:
                self._go(keep and failed is None)
                pool = nspool.pool()
                if pool is not None:
                    pool.refill()
        if failed is not None:
            for k in kids:  # outside the lock: closing a child releases our reference
                k.close()
            clear = _at_pids_limit(self, failed)
            if clear is not None:
                raise clear from failed
            raise failed
        return kids

    def _stop(self) -> tuple[dict, seize.Pinned]:
        """The template's processes seized and ptrace-stopped, the engine on their CPU (called
        with the lock held, in the engine's thread). Held ones stay frozen until a Tracee of
        theirs is looked up (_Waking), when one must run an injected call."""
        if self.held is not None and self.pin is not None:
            self.pin.repin_engine()  # another template's let_go may have unpinned it
            return self.held, self.pin
        tracees = seize.seize_all(self.body.cgroup, self.plans)
        try:
            if self.autoreap is None:
                self.autoreap = seize.ignore_children(tracees[self.body.init_pid])
            pin = seize.Pinned(tracees)
        except BaseException:
            seize.release_all(self.body.cgroup, tracees)
            if self.source:
                self.body.cgroup.thaw()
            raise
        self.hold(tracees, pin)
        assert self.held is not None
        return self.held, pin

    def hold(self, tracees: dict, pin: seize.Pinned) -> None:
        """Keep ``tracees`` (seized by the fork thread, pinned by ``pin``; the group thawed,
        as seize_all leaves it) until a fork or :meth:`let_go` lets them go."""
        self.held, self.pin, self.held_by = _Waking(tracees, self._wake), pin, os.getpid()
        self.awake = True
        keeper.holding(self)

    def _go(self, keep: bool) -> None:
        """After a fork: keep holding (refrozen once the engine is idle), or let go (a failed
        fork always does)."""
        if keep:
            keeper.fork_thread().post(self._doze_idle)
            return
        self._let_go_locked()

    # Held between forks the processes are ptrace-stopped and frozen: ptrace alone would let
    # them run if the trainer died. A fork thaws them only once it needs one to run (_Waking;
    # every fork through intermediates does, to reap them), and the refreeze after it is left
    # to the engine's idle time, off the caller's wait; forks that come first find them thawed.
    def _wake(self) -> None:
        if not self.awake:
            self.body.cgroup.thaw()
            self.awake = True

    def _doze(self) -> None:
        if self.awake:
            self.body.cgroup.freeze()  # ptrace-stopped tasks freeze at once
            self.awake = False

    def _doze_idle(self) -> None:
        with self.lock:
            if self.held is None:
                return
            try:
                self._doze()
            except BunshinError as e:
                log.warning("template %s: %s", self.id, e)
                self._let_go_locked()

    def let_go(self) -> None:
        """Let the engine's thread release the processes it holds: cured, frozen, detached."""
        if self.held is None or self.held_by != os.getpid():  # a process forked from ours has none
            return
        keeper.fork_thread().run(self._let_go_with_lock)

    def _let_go_with_lock(self) -> None:
        with self.lock:
            self._let_go_locked()

    def _let_go_locked(self) -> None:
        held, pin = self.held, self.pin
        self.held = self.pin = None
        keeper.released(self)
        if held is None:
            return
        if pin is not None:
            pin.restore()
        try:
            # held between forks they are frozen too, and curing may inject (re-queue signals
            # that came meanwhile): they stay in their ptrace stops when thawed
            self._wake()
        except BunshinError as e:
            log.warning("template %s: %s", self.id, e)
        for s in self.slots:  # intermediates made ahead live only while held
            if s.early is not None:
                earlyinit.drop_mids(s.early.mids, held)
        if self.source and self.awake and self.frozen_at is not None:
            # as after fork(2): its select or ppoll wakes at its deadline, not later by the
            # time the fork held it (the freezer made it write its time left)
            threads.count_down_source(self.plans, held, self.frozen_at)
            self.frozen_at = None
        # a source's workspace runs on, the same tasks: thawed above, they run once detached
        seize.release_all(self.body.cgroup, held, frozen=not (self.source and self.awake))
        if self.source and not self.awake:  # _wake() failed
            self.body.cgroup.thaw()
        self.awake = False

    def _fork_many(self, tracees, pin, on_fork, hostnames: list[str | None],
                   done: list, unrun: bool = False) -> None:
        """Every child's init first, then each template process cloned into all the children
        at once (one FORK call with the module; or, for an exact tree without it, each child's
        clones made by their parents' clones, tree.py), then each child finished and handed out
        into ``done``. On failure the children not yet handed out are removed completely; the
        ones in ``done`` (``on_fork`` run, running) are the caller's to close."""
        start = time.perf_counter()
        cl = cloners.cloner()
        kids: list[_Child] = []
        try:
            for host in hostnames:
                kids.append(_Child(self, tracees, pin, host, cl))
            if cl.in_child and len(self.plans) > 1:
                for k in kids:  # the clones are made in their init's root: it must be there
                    k.settle()
            if cl.exact_tree():  # each clone made by its parent's (tree.py)
                maker = tree.maker(self, tracees, cl.transplants)
                for k in kids:
                    maker.child(k)
            else:
                for pl in self.plans[1:]:
                    clones = cl.clone(functools.partial(tracees.__getitem__, pl.hostpid),
                                      pl, [k.init_pid for k in kids], self.tmp_pids[pl.hostpid],
                                      [k.take_mid(pl.hostpid) for k in kids],
                                      self.mids_reap_themselves(pl))
                    for k, c in zip(kids, clones):
                        k.clones.append(c)
                    for k, c in zip(kids, clones):
                        k.fix(pl, c)
            for k in kids:
                k.finish()
            while kids:
                done.append(kids[0].hand_out(on_fork, unrun))
                kids.pop(0)
        except BaseException:
            for k in kids:
                k.abort()
            raise
        done_ms = (time.perf_counter() - start) * 1e3
        for ws in done:
            log.info("forked %s from template %s in %.2f ms (%d at once, %d processes)",
                     ws.id, self.id, done_ms, len(hostnames), len(self.plans))


class _Waking(dict):
    """A held template's Tracees by host pid. Looking one up thaws the template first: a
    frozen task cannot run an injected call (woken by ptrace, it would freeze again before
    running it) and its threads' state cannot be read."""

    def __init__(self, tracees: dict, wake: Callable[[], None]) -> None:
        super().__init__(tracees)
        self._wake = wake

    def __getitem__(self, hostpid: int):
        self._wake()
        return super().__getitem__(hostpid)


class _Child:
    """One child of a fork call while it is being made: its slot, init and clones, and how
    to remove all of it."""

    def __init__(self, core: TemplateCore, tracees, pin, hostname: str | None,
                 cloner: cloners.Cloner) -> None:
        self.core, self.tracees, self.pin, self.cloner = core, tracees, pin, cloner
        self.clones: list = []
        self.ci: Tracee | None = None  # the child's init, from here until abort()
        self.chan: Channel | None = None  # its control channel, until finish() gives it to the body
        self.ws = None
        self.ctx: engine.ForkCtx | None = None  # made by context()
        self.copied = False  # the init is in its root with the template's /dev/shm and SysV objects (ready)
        self.body: Body | None = None
        self.pidfd = -1
        self.meta = None
        self.meta_written: Future | None = None  # the meta file's write, when another thread makes it
        self.masters: dict[int, int] = {}  # made ahead with the init, until ready() hands them on
        self.mids: dict = {}  # intermediates made ahead, until their process is cloned
        self.born_in_cg: set[int] = set()  # template pids whose clone came from one (in self.cg)
        self.asked: set[int] = set()  # template pids whose fixups' questions are answered (ask)
        self.settled = False  # the init is in its root, on its own CPUs (one made ahead is)
        slot = core.slots.pop() if core.slots else None  # core.lock is held by fork()
        ei = slot.early if slot is not None else None
        rooting = isinstance(ei, _RootingInit)  # on its way into its root: settle() waits
        if slot is not None and ei is not None and not (
                hostname is None and (rooting or ei.chan.ready and ei.meta is not None)):
            earlyinit.drop_mids(ei.mids, tracees)
            slot.destroy()  # its init did not settle, or has another hostname: start afresh
            core.child_init_gone()
            slot = None
        if slot is None:  # none made ahead: the same pieces, now (make() cleans up its own)
            try:
                slot = slots.make(core)
            except OSError as e:
                raise ForkError(f"cannot create the child's directory: {e}") from None
        # the child's directory and cgroup, until abort() (the cgroup: or finish() gives it to the body)
        self.d: WorkspaceDir | None
        self.cg: Cgroup | None
        self.d, self.cg, mfd = slot.dir, slot.cg, slot.mount_fd
        self.host = hostname or core.config.hostname
        if slot.early is not None:  # its init is in its root already (earlyinit.py)
            ei, slot.early = slot.early, None
            self.settled = not rooting  # else earlyinit.settle's wait is settle()'s
            self.ci, self.chan, self.pidfd, self.meta = ei.ci, ei.chan, ei.pidfd, ei.meta
            if isinstance(ei, _RootingInit):
                self.meta_written = ei.written
            self.masters, ei.masters = ei.masters, {}
            self.mids, ei.mids = ei.mids, {}
            return
        try:
            ei = earlyinit.start(tracees[core.body.init_pid], core.ctl_sock, mfd,
                                 self.host, self.cg, pin, f"workspace {self.d.id}")
            self.ci, self.chan, self.pidfd = ei.ci, ei.chan, ei.pidfd
        except BaseException:
            self.abort()
            raise
        finally:
            if mfd >= 0:
                os.close(mfd)

    def settle(self) -> None:
        """Wait for the init to be in its root (it moves there while the first clones are
        made, unless they are made in it) and give it back its CPUs."""
        if self.settled:
            return
        assert self.chan is not None  # finish() settled it before giving the channel away
        self.chan.wait_ready(10)
        self.pin.release_clone(self.core.body.init_pid, self.ci)
        self.settled = True

    @property
    def init_pid(self) -> int:
        """The host pid of the child's init."""
        assert self.ci is not None  # set by __init__ (or it raised), cleared by abort()
        return self.ci.pid

    def ready(self) -> engine.ForkCtx:
        """The init settled, give it what the clones' fixups expect: /dev/shm and SysV
        segments. Returns the context of the fixups."""
        if self.copied:
            return self.context()
        core = self.core
        self.settle()
        tinit = core.body.init_pid
        if core.dev_shm_used is None:
            core.dev_shm_used = engine.dev_shm_used(tinit)
        if core.dev_shm_used:
            engine.copy_dev_shm(tinit, self.init_pid)
        segments, sets, queues = core.sysv
        sysv_shm.copy_segments(tinit, self.init_pid, segments)
        sysv_sem.copy_sets(self.init_pid, sets)
        sysv_msg.copy_queues(self.init_pid, queues)
        self.copied = True
        return self.context()

    def context(self) -> engine.ForkCtx:
        """The context of the clones' fixups (its init need not be in its root yet)."""
        if self.ctx is None:
            core = self.core
            self.ctx = engine.ForkCtx(init_hostpid=self.init_pid, plans={pl.vpid: pl for pl in core.plans},
                                      cloner=self.cloner,
                                      shared={"tracees": self.tracees, "template-upper": str(core.own_upper or ""),
                                              "pty_masters": self.masters, "thread_cpus": self.pin.of_thread},
                                      cpus=self.pin.of_pid if self.cloner.fixups_in_kernel else {})
            self.masters = {}
        return self.ctx

    def take_mid(self, hostpid: int):
        """The intermediate made ahead for the clone of ``hostpid``, if any (it is in this
        child's cgroup, and so will be the clone)."""
        mid = self.mids.pop(hostpid, None)
        if mid is not None and self.cloner.through_intermediates:  # else it is ended unused
            self.born_in_cg.add(hostpid)
        return mid

    def fix(self, pl, c) -> None:
        """Fix up ``c``, the clone of ``pl``. What needs not the init in its root comes first,
        while it may still be moving there: the clone's cgroup, the template's answers."""
        cg = self.cg
        assert cg is not None  # before finish()
        if pl.hostpid not in self.born_in_cg and not self.cloner.in_child:
            cg.add(c.pid)  # first: its threads are then born there, not under the template's limit
        self.ask(pl)
        ctx = self.ready()
        engine.fix_process(ctx, pl, c)
        if pl.hostpid not in ctx.cpus:  # not given back with its fixups
            self.pin.release_clone(pl.hostpid, c)

    def ask(self, pl) -> None:
        """Ask ``pl``'s template process what its clone's fixups need (resources.ask_template),
        once; the init need not be in its root yet."""
        if pl.hostpid not in self.asked:
            resources.ask_template(self.context(), pl)
            self.asked.add(pl.hostpid)

    def finish(self) -> None:
        ctx = self.ready()  # a workspace of its init alone has had no fixup to wait for it
        d, cg = self.d, self.cg
        assert d is not None and cg is not None  # finish() runs once, and not after abort()
        core = self.core
        clones = {pl.vpid: c for pl, c in zip(core.plans[1:], self.clones)}
        self.cloner.reparent(core.plans, clones)
        self.cloner.join_sessions(core.plans, clones)
        engine.finish_child(ctx)
        masters = ctx.shared.pop("pty_masters", {})  # the Workspace's from here on
        meta = self.meta
        if self.meta_written is not None:
            self.meta_written.result()
        if meta is None:
            meta = core.child_meta(d, cg, self.init_pid)
            d.write_meta(meta)
        body = Body(d, cg, meta, core.child_rootfs(), init_pid=self.init_pid,
                    pidfd=self.pidfd, init_is_child=False, channel=self.chan,
                    userns=core.body.userns)
        try:
            body.open_root()
            ws = core.build(core.config, body, session_copies(core.shells, masters))
        except BaseException:
            # The body never became a workspace's: abort() removes its parts, masters included.
            if body.root_fd >= 0:
                os.close(body.root_fd)
            self.masters.update(masters)
            raise
        body.template = core
        core.refs += 1  # core.lock is held by fork()
        self.body = body
        self.pidfd, self.chan, self.cg = -1, None, None  # owned by the body now
        self.ws = ws

    def hand_out(self, on_fork, unrun: bool = False):
        """``on_fork``, then let the clones run (``unrun``: go, frozen before they run an
        instruction): the workspace is the caller's."""
        if on_fork is not None:
            on_fork(self.ws)
        if unrun:
            assert self.body is not None  # finish() made it
            for c in self.clones:  # curing may inject (queue signals again): not once frozen
                c.cure()
            self.body.cgroup.freeze()  # ptrace-stopped: they freeze at once
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
        earlyinit.drop_mids(self.mids, self.tracees)  # before the init, whose namespace they hold
        if self.ws is not None:  # finished: the workspace owns the rest
            ws, self.ws = self.ws, None
            self.body.template = None  # we hold the lock: give the reference back by hand
            self.core.refs -= 1
            ws.close()
            return
        masters = {**self.masters, **(self.ctx.shared.pop("pty_masters", {}) if self.ctx else {})}
        self.masters = {}
        for m in masters.values():
            os.close(m)
        if self.chan is not None:
            self.chan.close()  # the child's init sees EOF and takes its namespace down
            self.chan = None
        if self.ci is not None:
            try:  # through the pidfd: once dead, the kernel reaps it (seize.ignore_children)
                if self.pidfd >= 0:
                    signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
                else:
                    os.kill(self.ci.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if self.pidfd >= 0:
                wait_exit_pidfd(self.pidfd, 5)
            self.ci = None
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        if self.cg is not None:
            self.cg.destroy()
            self.cg = None
        _wait_quietly(self.meta_written)
        if self.d is not None:
            self.d.remove()
            self.d = None


def _empty(path: Path) -> bool:
    with os.scandir(path) as it:
        return next(it, None) is None


def snapshot_body(body: Body, config: WorkspaceConfig, shells: list[tuple[int, int, str]],
                  build: Build) -> TemplateCore:
    """Freeze a body for good: its processes become a template, which owns it once made, and
    is planned ahead of its first fork (TemplateCore.plans); on failure thaw and raise."""
    cg = body.cgroup
    if not cg.frozen():  # an unrun fork is (hand_out)
        cg.freeze()
    try:
        core = TemplateCore(body, None, shells, config, build)
    except BaseException:
        cg.thaw()
        raise
    keeper.fork_thread().post(core.plan_idle)
    return core


def sysv_objects(init_pid: int, plans) -> tuple:
    """The template's SysV segments, semaphore sets and message queues (sysv_sem refuses what
    it cannot carry)."""
    if not in_ipc_ns(init_pid, _any_sysv):  # most workspaces: one visit of the namespace, not three
        return [], sysv_sem.Sets([], {}), sysv_msg.Queues([], {})
    return sysv_shm.segments(init_pid), sysv_sem.sets(init_pid, plans), sysv_msg.queues(init_pid)


def _any_sysv() -> bool:
    return any(sysv_ids(kind) for kind in ("shm", "sem", "msg"))


def _child_lowers(own: Path, body: Body) -> tuple[Path, ...]:
    """The lower layers of a child of ``body`` whose upper layer, frozen, is ``own``: an
    empty one is left out."""
    return (*(() if _empty(own) else (own,)), *body.rootfs.lowers)


def freeze_source(body: Body, config: WorkspaceConfig, shells: list[tuple[int, int, str]],
                  build: Build, spares: slots.Spares | None = None) -> TemplateCore:
    """Freeze a running workspace for one fork: plan it and copy its upper layer. The core
    holds ``body`` (Body.hold) and leaves it frozen: the fork thaws it as it lets it go, a
    caller whose fork never started thaws it. On failure it is thawed and nothing is left.
    With one of ``spares``, the first child's root is mounted beside the plan too (the core's
    slot, which the caller closes after the fork: TemplateCore.close_slots)."""
    cg = body.cgroup
    cg.freeze()
    # every task is in the freezer by now: the time left of a blocked call it keeps in its own
    # memory (select, ppoll) was written before this, and counts down from it (resources/threads.py)
    frozen_at: float | None = time.monotonic()
    frozen = body.dir.frozen_path()
    copy: Future | None = None
    sp = spares.take() if spares is not None else None  # the first child's root goes on it

    def before_thaw() -> None:  # a copy must not miss what the group writes while it runs
        nonlocal copy, sp
        if copy is not None:
            if _discard(copy, frozen):
                sp = None  # gone with the slot made on it
            copy = None

    seized: tuple[dict, seize.Pinned] | None = None
    try:
        # the copy (a btrfs snapshot: a transaction commit, waited for without the GIL) and
        # the overlay mount on it are made in the copy's thread while the fork thread plans
        # and seizes the processes (each stops before its next instruction: nothing it could
        # write is missed by the copy), then clones the first child's init into the spare's
        # cgroup, and sends it into its root once the copy is mounted
        copy = _start_copy(body, frozen, sp, until_started=False)
        try:
            plans, sysv, seized = keeper.fork_thread().run(
                _plan_and_seize, cg, body.init_pid, body.channel, sp, copy, config.hostname, frozen_at)
        except Unsettled:
            # the group runs in short spells until the process is through (_plan_settled),
            # without the copy, which is made again once the plan is
            before_thaw()
            if sp is None:
                sp = spares.take() if spares is not None else None
            plans, sysv = _plan_settled(cg, before_thaw), None
            frozen_at = None  # it ran in spells: the seize's stop is when it was taken
            copy = _start_copy(body, frozen, sp)
            seized = keeper.fork_thread().run(_seize_source, cg, plans)
        try:
            slot = copy.result()
        except (OSError, BunshinError) as e:
            raise ForkError(f"workspace {body.id}: its children's copy of its files: {e}", step="snapshot") from None
        if slot is None and sp is not None:
            sp.destroy()
        sp = None  # the slot's
        core = TemplateCore(body, plans, shells, config, build, frozen_upper=frozen, sysv=sysv)
        core.frozen_at = frozen_at
        core.hold(*seized)
        seized = None  # the core's: its fork, or its release, lets them go
        if slot is not None:
            ei = slot.early
            if isinstance(ei, _RootingInit):  # written beside the fork, not in it
                ei.meta = core.child_meta(slot.dir, slot.cg, ei.ci.pid)
                ei.written = _copier_pool().submit(slot.dir.write_meta, ei.meta)
            core.slots.append(slot)
    except BaseException:
        if copy is not None and _discard(copy, frozen):  # the source stays frozen until the copy is over
            sp = None  # gone with the slot made on it
        if sp is not None:
            sp.destroy()
        if seized is not None:
            keeper.fork_thread().run(_release_source, cg, *seized)
        cg.thaw()
        raise
    body.hold()
    return core


def _plan_and_seize(cg, init_pid: int, chan, sp: slots.Spare | None, copy: Future,
                    hostname: str, frozen_at: float | None) -> tuple[list, tuple, tuple[dict, seize.Pinned]]:
    """A frozen source's plan with its SysV objects and its processes seized (_seize_source),
    in the fork thread: one hand-off for all, while the caller's thread waits for the copy.
    Given a spare, the first child's init too (_init_beside_copy). Unsettled: nothing seized."""
    plans = plan_tree(cg.pids())
    for pl in plans:  # its blocked calls' time left was taken at the freeze, not at the seize
        pl.stopped_at = frozen_at
    sysv = sysv_objects(init_pid, plans)  # may refuse: before anything is seized
    tracees, pin = _seize_source(cg, plans)
    if sp is not None and earlyinit.enabled():
        try:
            _init_beside_copy(tracees[init_pid], chan.sock, sp, pin, copy, hostname)
        except BaseException:
            _release_source(cg, tracees, pin)
            raise
    return plans, sysv, (tracees, pin)


def _init_beside_copy(tinit: Tracee, tpl_sock, sp: slots.Spare, pin: seize.Pinned,
                      copy: Future, hostname: str) -> None:
    """Clone a ``ws.fork()``'s first child's init into the spare's cgroup while the copy is
    made (the fork would clone it only once the copy is over), and send it into its root as
    soon as the copy has mounted it (a _RootingInit, the slot's ``early``). On failure the
    fork makes its own."""
    try:
        ci, made = engine.clone_init_unrooted(tinit, sp.cg, pin)
    except (BunshinError, OSError) as e:
        log.info("workspace %s: the child's init not cloned beside the copy: %s", sp.dir.id, e)
        return
    try:
        slot = copy.result()
    except BaseException:  # noqa: BLE001 - the caller raises it, from copy.result() too
        slot = None
    if slot is None:  # no root for it
        engine.discard_clone(ci)
        if made:
            made.close()
        return
    try:
        sock = engine.reroot(ci, tpl_sock, slot.mount_fd, hostname, made)
        pidfd = earlyinit.pidfd_of(ci, sock)
    except (BunshinError, OSError) as e:  # reroot killed it
        log.info("workspace %s: the child's init cloned beside the copy: %s", sp.dir.id, e)
        return
    os.close(slot.mount_fd)
    slot.mount_fd = -1
    slot.early = _RootingInit(ci, Channel(sock, f"workspace {slot.dir.id}"), pidfd)


@dataclass
class _RootingInit(earlyinit.EarlyInit):
    """A child's init told to move into its root, not known to be there yet: the fork waits
    for it (_Child.settle). Its meta file is written by the copy's thread meanwhile."""

    written: Future | None = None  # the write of its meta file

    def discard(self) -> None:
        _wait_quietly(self.written)  # before its directory goes
        super().discard()


def _wait_quietly(f: Future | None) -> None:
    if f is not None:
        try:
            f.result()
        except BaseException:  # noqa: BLE001 - its directory goes all the same
            pass


def _seize_source(cg, plans: list) -> tuple[dict, seize.Pinned]:
    """A source's processes seized and pinned, in the fork thread (TemplateCore._stop's
    work, done while the copy is made; a source's init is not asked to ignore SIGCHLD)."""
    tracees = seize.seize_all(cg, plans)
    try:
        return tracees, seize.Pinned(tracees)
    except BaseException:
        seize.release_all(cg, tracees)
        raise


def _release_source(cg, tracees: dict, pin: seize.Pinned) -> None:
    """Let go of what _seize_source seized, for a source whose core was never made: left
    frozen (the caller thaws it)."""
    pin.restore()
    seize.release_all(cg, tracees)


def _start_copy(body: Body, frozen: Path, sp: slots.Spare | None,
                until_started: bool = True) -> Future:
    """_copy_upper in the copy's thread; ``until_started``: returns once that thread is in the
    copy's system call, for a caller that plans meanwhile (a thread waiting for the GIL while
    this one plans could wait for as long as the plan)."""
    try:
        make = layers.prepare_freeze(body.dir.layer, frozen)
    except OSError as e:
        raise ForkError(f"workspace {body.id}: its children's copy of its files: {e}", step="snapshot") from None
    started = threading.Event()
    copy = _copier_pool().submit(_copy_upper, make, started, body, frozen, sp)
    if until_started:
        started.wait()
    return copy


def _copy_upper(make: Callable[[], None], started: threading.Event, body: Body, frozen: Path,
                sp: slots.Spare | None) -> slots.Slot | None:
    """``body``'s upper layer frozen at ``frozen`` (by ``make``), and a slot for its first
    child, its root mounted on it (on the spare ``sp``, which the slot takes over; None if
    there is none, or the mount failed: ``sp`` stays the caller's)."""
    started.set()
    make()
    if sp is None:
        return None
    try:
        lowers = _child_lowers(frozen / "upper", body)
        return slots.Slot(sp.dir, sp.cg, engine.overlay_fd(lowers, sp.dir.upper, sp.dir.work,
                                                         body.userns))
    except BaseException:  # noqa: BLE001 - the fork mounts one itself, and says what fails
        return None


def _discard(copy: Future, frozen: Path) -> bool:
    """Once the copy is over, remove what it made; returns whether that was a slot (its
    spare goes with it)."""
    try:
        slot = copy.result()
    except BaseException:  # noqa: BLE001 - nothing made (layers.freeze leaves nothing on failure)
        return False
    if slot is not None:
        slot.destroy()
    layers.remove(frozen)
    return slot is not None


# the thread that copies sources' upper layers, then writes the meta file of the first child
# of each (freeze_source)
_copier = PerProcess(lambda: ThreadPoolExecutor(1, thread_name_prefix="bunshin-layer-copy"))


def _copier_pool() -> ThreadPoolExecutor:
    pool = _copier.get()
    assert pool is not None  # its make() never turns it off
    return pool


VFORK_WAIT_S = 2.0  # how long a snapshot lets a vfork child run to its exec


def _plan_settled(cg, before_thaw: Callable[[], None] | None = None) -> list:
    """The plan of a frozen group, thawed for short spells while a process is Unsettled: a
    vfork's child usually execs within a millisecond, and until then the parent could not be
    seized; a process exiting is gone as soon. ``before_thaw`` is called before each spell."""
    deadline = time.monotonic() + VFORK_WAIT_S
    spell = 0.0005
    while True:
        try:
            return plan_tree(cg.pids())
        except Unsettled as e:
            if time.monotonic() + spell > deadline:
                raise ForkError(f"{e} after {VFORK_WAIT_S:g} s, and a fork cannot copy a process "
                                f"in that state: {e.wait_for}", pid=e.pid, step="snapshot") from None
            log.debug("%s: letting it run %.1f ms", e, spell * 1e3)
            if before_thaw is not None:
                before_thaw()
            cg.thaw()
            time.sleep(spell)
            cg.freeze()
            spell = min(spell * 2, 0.05)


def _at_pids_limit(core: TemplateCore, e: BaseException) -> ForkError | None:
    """What to say of a clone the template's pids limit refused (the kernel says only EAGAIN):
    a fork's child init, and each intermediate, is born in the template's cgroup and moved to
    the child's after, so a fork needs two pids free there."""
    limit = core.config.limits.pids
    if limit is None or not isinstance(e, ForkError) or e.errno != errno.EAGAIN:
        return None
    try:
        now = core.body.cgroup.stats().pids_current
    except (BunshinError, OSError):
        return None
    if now is None or now + 2 <= limit:
        return None  # not this limit: the kernel's own (pid_max, threads-max)
    return ForkError(f"the workspace is at its pids limit ({now} of {limit} processes and threads), "
                     "and a fork needs 2 more while it runs (its child's init and an intermediate "
                     "are made beside the source's processes, then moved to the child's group): "
                     f"create the workspace with pids_limit of at least {now + 2}, or end a "
                     "process, before forking", pid=e.pid, step=e.step, errno=e.errno)


def _close_all(kids: list) -> None:
    """What a fork made for a caller that stopped waiting for it (KeyboardInterrupt)."""
    for k in kids:
        k.close()


def check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ForkError(f"n must be an int ≥ 1 (how many children), got {n!r}")
