"""How a fork makes its clones: one Cloner per fork backend.

A fork makes each template process again in every child (with its own pid in the child's pid
namespace, its memory shared copy-on-write), fixes each clone up (engine.fix_process), and,
where the kernel lets it, makes the child's process tree and sessions the template's. What
the kernel offers decides how; :func:`cloner` chooses a Cloner once per answer of
``_core.kmod.backend()`` (chosen once per process, and again after ``kmod.reset()``, as the
tests and benchmarks do when they change ``BUNSHIN_KMOD*``), and the engine, templates and
slots only call its methods. Where clones enter the child by their own system calls, a
process that may not (one under another uid) is transplanted instead, whatever the backend
(transplant.py: the child's init makes a blank with its pid that becomes it, its memory
copied; Cloner.transplants, finish_child):

- :class:`Injection` (a stock kernel): clone3 with set_tid can only put a child in the
  caller's pid namespace or one below it, and the clone must end up a child of the child's
  init. So each clone is made through an intermediate: a stopped CLONE_VM child of the
  template process (nothing copied) in the child's pid namespace (engine.make_mid), from
  which the clone is made before the intermediate is killed, and its orphan adopted by the
  child's init. Intermediates can be made ahead into a slot, in the child's cgroup, so that
  the clone is born there (earlyinit.py). So made, every clone is a child of the child's
  init, in the template's session (``BUNSHIN_TREE=flat``); by default each is made by its
  parent's clone instead (tree.py: a parent's clone holds its heir's memory until it has made
  its children, then is transplanted), the child's tree and sessions then the template's.
- :class:`Reparent` (the module's REPARENT, without FORK or with ``BUNSHIN_KMOD_FORK=0``):
  one injected clone3 straight from the template process into the child's pid namespace, the
  clone moved under the child's init while still stopped. Once all exist, each is moved
  under the clone of its parent, and (JOIN_SESSION, when the module has it) into the
  session and group of its leaders' clones: the child's tree and sessions are the template's.
- :class:`KernelFork` (FORK): the template process clones itself in the kernel into all
  children in one resume, no injected call; tree and sessions as with Reparent. A module
  with IN_PARENT (0.5.0) makes each clone in its parent's namespaces, root and cgroups:
  its fixups neither join the namespaces nor move it, but the child's init must be in its
  root before the first clone.
- :class:`KernelForkRun` (FORK and RUN): the fixups too are made by the clone itself in the
  kernel, one resume per queue (remote.RunRemote), which gives the clone its CPUs back.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable

from .. import config
from .._core.kmod import FORK_MAX_CHILDREN, Backend, Kmod, backend
from .._core.kmod import why as kmod_why
from ..compel import Tracee
from ..errors import BunshinError, ForkError
from . import engine, transplant
from .plan import CLONE_CAPS, ProcPlan
from .remote import Remote, RunRemote

# module version whose FORK lends a task without CAP_CHECKPOINT_RESTORE (one under another uid)
# that capability for its copy's chosen pid
_LENDS_SET_TID_SINCE = (0, 6, 0)

__all__ = ["Cloner", "Injection", "KernelFork", "KernelForkRun", "Reparent", "cloner"]


class Cloner:
    """What differs between the fork backends; see the module's docstring."""

    name = ""
    in_child = False
    """Clones are born in the child's namespaces, root and cgroups: the child's init must be
    in its root before the first clone, and the fixups neither setns nor move the clone."""
    through_intermediates = False
    """Clones are made through intermediates, and so from those made ahead (make_mids):
    such a clone is born in the child's cgroup."""
    fixups_in_kernel = False
    """A clone's fixups run in the kernel, and give it back its CPUs with them."""
    clone_enters_child = True
    """A clone gets into the child by its own system calls (clone3 with set_tid into the
    child's pid namespace, setns into the others), which need the capabilities of
    plan.CLONE_CAPS in the process cloned: one that dropped them (running under another uid)
    is transplanted instead (transplant.py, :meth:`transplants`); False where the kernel places
    it there (FORK IN_PARENT, of a module that lends the pid's capability: its checks are the
    trainer's), so that such a process is cloned as any other."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"

    def exact_tree(self) -> bool:
        """Whether each clone is made by its parent's clone (tree.py), the child's tree and
        sessions then the template's; here the kernel moves clones instead (reparent)."""
        return False

    def cannot_enter(self, proc: ProcPlan) -> str | None:
        """Why ``proc``, which lacks the capabilities of plan.CLONE_CAPS, cannot be forked by
        this backend (None: it can, transplanted); asked only where clones enter the child by
        their own system calls."""
        why = transplant.refusal(proc)
        return None if why is None else (
            "this fork clones each process from inside it, or transplants one that cannot "
            f"(a blank made by the child's init becomes it, its memory copied), but it {why}")

    def transplants(self, proc: ProcPlan) -> bool:
        """Whether ``proc``'s clones are transplants (transplant.py): it could not enter the
        child by its own system calls; or, placed there by the kernel, it would run under its
        own uid fixups that need root (its other threads and its zombies take their pids with
        clone3's set_tid, a SysV segment's copy is attached again), where a transplant, root
        until its last fixup, can carry it."""
        if all(proc.cap_eff >> bit & 1 for _, bit in CLONE_CAPS):
            return False
        if self.clone_enters_child:
            return True
        return bool(len(proc.threads) > 1 or getattr(proc, "zombies", None)
                    or getattr(proc, "sysv_maps", None)) and transplant.refusal(proc) is None

    def after_fixups(self, ctx: engine.ForkCtx, proc: ProcPlan, child: Tracee) -> None:
        """After every resource's fixups of a clone."""
        read = getattr(child, "transplanted", None)
        if read is not None:  # its credentials once the child is whole: its zombies are made
            # (engine.finish_child) by it, as root
            ctx.shared.setdefault("transplants", []).append((proc, child, read))
            child.transplanted = None  # type: ignore[attr-defined]

    def finish_child(self, ctx: engine.ForkCtx) -> None:
        """After every resource's finish of a child (engine.finish_child)."""
        for proc, child, read in ctx.shared.pop("transplants", []):
            transplant.set_credentials(child, f"process {proc.vpid} ({proc.name})", read,
                                       getattr(proc, "pdeath_signal", None))

    def clone(self, source: Callable[[], Tracee], proc: ProcPlan, child_inits: list[int],
              tmp_pid: int, ahead: list[Tracee | None] | None = None,
              sibling: bool = False) -> list[Tracee]:
        """Clone ``proc`` into each child's pid namespace (one per pid in ``child_inits``, the
        children's inits) with its own PID, parented to that child's init; returns the clones
        in that order, stopped and traced. ``tmp_pid``, ``ahead`` and ``sibling`` are for the
        intermediates (:class:`Injection`): ``ahead[i]``, when there, is child i's made ahead;
        a backend that needs none ends them unused. On failure no clone is left, nor any
        intermediate.

        ``source()`` gives the template process, called only when it must run (it may thaw a
        held template). Dead intermediates are reaped in it before this returns: until then
        each is a zombie in the child's pid namespace and cgroup."""
        out: list[Tracee] = []
        mids: list[int] = []  # dead intermediates, as the template process sees them
        ahead = list(ahead) if ahead is not None else [None] * len(child_inits)
        try:
            if self.transplants(proc):
                proc.transplanted = True  # its fixups run as root (resources read it)
                self._transplant(source(), proc, child_inits, out)
            else:
                self._clone(source, proc, child_inits, tmp_pid, ahead, mids, sibling, out)
            _end_unused(ahead, mids)
            if mids:
                engine.reap_in(source(), mids)
        except BaseException:
            for c in out:
                engine.discard_clone(c)
            _end_unused(ahead, mids)
            try:
                if mids:
                    engine.reap_in(source(), mids)
            except BunshinError:
                pass  # the template process is what failed: the fork says so already
            raise
        return out

    @staticmethod
    def _transplant(tp: Tracee, proc: ProcPlan, child_inits: list[int], out: list[Tracee]) -> None:
        """Each clone made by its child's init, which becomes ``proc``: read once."""
        read = transplant.read_source(tp, proc)
        for child_init in child_inits:
            blank = transplant.make_by_init(child_init, tp, read, proc)
            blank.transplanted = read  # type: ignore[attr-defined]  # its credentials: finish_child
            out.append(blank)

    def _clone(self, source: Callable[[], Tracee], proc: ProcPlan, child_inits: list[int],
               tmp_pid: int, ahead: list[Tracee | None], mids: list[int], sibling: bool,
               out: list[Tracee]) -> None:
        """The clones into ``out``; an intermediate used from ``ahead`` is set to None there,
        and each killed one goes into ``mids``."""
        raise NotImplementedError

    def make_mids(self, into: dict[int, Tracee], core, tracees: dict, child_init: int, cg) -> None:
        """The intermediates of a child's clones made ahead of its fork (earlyinit.make_mids),
        into ``into`` by template pid as they are made; none where clones need none."""

    def reparent(self, plans: list[ProcPlan], clones: dict[int, Tracee]) -> int:
        """Put each clone (``{vpid: clone}``, all stopped and traced by this thread) under the
        clone of its template parent; returns how many moved. Here none can: the clones stay
        children of the child's init."""
        return 0

    def join_sessions(self, plans: list[ProcPlan], clones: dict[int, Tracee]) -> int:
        """Put each clone that is not a session leader into the session of its session
        leader's clone and the group of its group leader's clone; returns how many moved.
        Here none can: a clone keeps its template's session, outside the child's pid
        namespace."""
        return 0

    def remote(self, child: Tracee, what: str) -> Remote:
        """Where a clone's fixups run: injected system calls."""
        return Remote(child, what)


def _end_unused(ahead: list[Tracee | None], mids: list[int]) -> None:
    for mid in ahead:
        if mid is not None:
            engine.end_mid(mid, mids)
    ahead[:] = [None] * len(ahead)


class Injection(Cloner):
    """Without the module: injected clone3 through an intermediate."""

    name = "injection"
    through_intermediates = True

    def exact_tree(self) -> bool:
        return config.fork_tree() == "exact"

    def _clone(self, source, proc, child_inits, tmp_pid, ahead, mids, sibling, out) -> None:
        for i, ci in enumerate(child_inits):
            mid, ahead[i] = ahead[i], None
            out.append(self.through(source, proc, ci, tmp_pid, mids, mid, sibling))

    @staticmethod
    def through(source: Callable[[], Tracee], proc: ProcPlan, child_init: int, tmp_pid: int,
                 mids: list[int], mid: Tracee | None, sibling: bool) -> Tracee:
        """The clone through an intermediate (``mid`` when one was made ahead); the dead
        intermediate goes into ``mids`` for the caller to reap, with the others of the call."""
        if mid is None:
            tp = source()
            try:
                mid = engine.make_mid(tp, child_init, tmp_pid, sibling)
            except ForkError as e:
                raise clone_failed(proc, "its intermediate", tmp_pid, e) from None
        try:
            return mid.clone(set_tid=proc.vpid, owe_robust=True)  # fix_process sets it
        except ForkError as e:
            raise clone_failed(proc, "its clone", proc.vpid, e) from None
        finally:
            engine.end_mid(mid, mids)

    def make_mids(self, into, core, tracees, child_init, cg) -> None:
        """Each in the child's cgroup ``cg``, so the clone made from it is born there; a
        ForkError (EAGAIN: a pids limit) leaves those made so far in ``into``."""
        for pl in core.plans[1:]:
            if self.transplants(pl):  # made by the child's init, at the fork
                continue
            mid = engine.make_mid(tracees[pl.hostpid], child_init, core.tmp_pids[pl.hostpid],
                                  core.mids_reap_themselves(pl))
            into[pl.hostpid] = mid
            cg.add(mid.pid)
            mid.learn()  # what its clone in the fork will need


def clone_failed(proc: ProcPlan, what: str, pid: int, e: ForkError) -> ForkError:
    """compel's error for a clone, which knows only a host pid and a step, said of the
    template process it was for."""
    name = f"process {proc.vpid} ({proc.name})"
    if e.errno == errno.EEXIST:
        msg = (f"{name}: {what} needs pid {pid} in the child's pid namespace and that pid is in "
               f"use there (clone3 set_tid: {os.strerror(e.errno)})")
    else:
        why = os.strerror(e.errno) if e.errno else str(e)
        msg = f"{name}: {what} could not be made in the child: {why} (step {e.step!r})"
    return ForkError(msg, pid=e.pid, step=e.step, errno=e.errno)


class Reparent(Cloner):
    """The module's REPARENT (and JOIN_SESSION when ``sessions`` is given), clones injected."""

    name = "reparent"

    def __init__(self, k: Kmod, sessions: Kmod | None) -> None:
        self._k = k
        self._sessions = sessions

    def _clone(self, source, proc, child_inits, tmp_pid, ahead, mids, sibling, out) -> None:
        for ci in child_inits:
            out.append(self._reparented(source(), proc, ci))

    def _reparented(self, tp: Tracee, proc: ProcPlan, child_init: int) -> Tracee:
        """One injected clone3 instead of two plus a kill and a wait: the clone's parent is the
        template process until REPARENT moves it, still stopped, under the child's init."""
        try:
            child = tp.clone(pidns_owner=child_init, set_tid=proc.vpid)
        except ForkError as e:
            raise clone_failed(proc, "its clone", proc.vpid, e) from None
        try:
            self._k.reparent(child.pid, child_init, traced=True)
        except OSError as e:
            as_seen = child.in_parent
            os.kill(child.pid, signal.SIGKILL)
            # as its tracer: hands the zombie to its real parent (cannot block: SIGKILL ends a
            # ptrace-stopped single-threaded task at once)
            os.waitpid(child.pid, engine.WALL)
            child._ctl = None
            tp.syscall(61, as_seen, 0, engine.WALL, 0)  # wait4 in the template process, its parent
            raise ForkError(f"/dev/bunshin REPARENT of process {proc.vpid} ({proc.name}) under the "
                            f"child's init: {e.strerror}", pid=child.pid, step="reparent",
                            errno=e.errno) from None
        return child

    def reparent(self, plans, clones) -> int:
        moved = 0
        for proc in plans:
            parent = clones.get(proc.ppid)
            child = clones.get(proc.vpid)
            if parent is None or child is None:  # init's children (ppid 1) are already right
                continue
            try:
                self._k.reparent(child.pid, parent.pid, traced=True)
            except OSError as e:
                raise ForkError(f"/dev/bunshin REPARENT of process {proc.vpid} ({proc.name}) under "
                                f"{proc.ppid}: {e.strerror}", pid=child.pid, step="reparent",
                                errno=e.errno) from None
            moved += 1
        return moved

    def join_sessions(self, plans, clones) -> int:
        """A process whose session or group leader is gone from the template (a `sh -c` that
        exited) keeps its own: there is nothing to join."""
        k = self._sessions
        if k is None:  # a module without JOIN_SESSION: as without the module
            return 0
        moved = 0
        # group leaders first: a group can be joined only once it is in the session
        for proc in sorted(plans, key=lambda pl: pl.pgid != pl.vpid):
            child, leader = clones.get(proc.vpid), clones.get(proc.sid)
            group = child if proc.pgid == proc.vpid else clones.get(proc.pgid)
            if child is None or leader is None or group is None or proc.sid == proc.vpid:
                continue
            try:
                k.join_session(child.pid, leader.pid, group.pid)
            except OSError as e:
                raise ForkError(f"/dev/bunshin JOIN_SESSION of process {proc.vpid} ({proc.name}) "
                                f"into session {proc.sid}, group {proc.pgid}: {e.strerror}",
                                pid=child.pid, step="session", errno=e.errno) from None
            moved += 1
        return moved


class KernelFork(Reparent):
    """The module's FORK (IN_PARENT when ``in_parent``), with REPARENT after."""

    name = "kmod FORK"

    def __init__(self, k: Kmod, sessions: Kmod | None, in_parent: bool) -> None:
        super().__init__(k, sessions)
        self.in_child = in_parent
        self.clone_enters_child = not (in_parent and k.module_version >= _LENDS_SET_TID_SINCE)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}{' IN_PARENT' if self.in_child else ''}>"

    def _clone(self, source, proc, child_inits, tmp_pid, ahead, mids, sibling, out) -> None:
        for at in range(0, len(child_inits), FORK_MAX_CHILDREN):  # one call per chunk
            out += self._fork_chunk(source(), proc, child_inits[at:at + FORK_MAX_CHILDREN])

    def _fork_chunk(self, tp: Tracee, proc: ProcPlan, inits: list[int]) -> list[Tracee]:
        """One FORK: the template process is resumed once, clones itself in the kernel into
        each child's namespace and stops again; no injected system call. A signal or a trap
        pending for it (EAGAIN: it would stop for that first) is taken by one injected no-op,
        which holds the signal back and steps through the trap, and the call is made again. A
        process stopped by a signal has such a trap: its seize found it in its group stop
        already, and the stop the seize asked for besides is still to come."""
        want = [(ci, proc.vpid, ci) for ci in inits]
        k, in_parent = self._k, self.in_child
        for attempt in (0, 1):
            try:
                return tp.clone_by(lambda addr: k.fork(tp.pid, want, addr, in_parent),
                                   [proc.vpid] * len(want))
            except OSError as e:  # clone_by has killed what it made
                if e.errno == errno.EAGAIN and attempt == 0:
                    tp.syscall(39)  # getpid
                    continue
                raise ForkError(f"/dev/bunshin FORK of process {proc.vpid} ({proc.name}) into "
                                f"{len(want)} children: {kmod_why(e)}", pid=tp.pid, step="fork",
                                errno=e.errno) from None
        raise AssertionError("unreachable")


class KernelForkRun(KernelFork):
    """FORK, with each clone's fixups made in the kernel by RUN."""

    name = "kmod FORK+RUN"
    fixups_in_kernel = True

    def remote(self, child: Tracee, what: str) -> Remote:
        return RunRemote(child, what, self._k)


def _choose(b: Backend) -> Cloner:
    if b.fork is not None:
        kind = KernelForkRun if b.run is not None else KernelFork
        return kind(b.fork, b.join_session, in_parent=b.fork_in_parent is not None)
    if b.reparent is not None:
        return Reparent(b.reparent, b.join_session)
    return Injection()


_chosen: tuple[Backend, Cloner] | None = None


def cloner() -> Cloner:
    """The Cloner of the backend in use, made again only when the backend is chosen again
    (kmod.reset()). Raises as ``backend()`` does."""
    global _chosen
    b = backend()
    chosen = _chosen
    if chosen is None or chosen[0] is not b:
        chosen = _chosen = (b, _choose(b))
    return chosen[1]
