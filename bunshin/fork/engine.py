"""The fixup half of a fork, and the loop over it.

Per child: a detached overlay root is built from the template's layers; the template's init
is cloned into new pid/mnt/net/ipc/uts namespaces and told (REROOT) to move into that root;
every other process is cloned into the child's pid namespace with its own PID (clone3 +
set_tid) through a short-lived intermediate, so that its parent becomes the child's init; then
each clone joins the child's namespaces and every descriptor is recreated by its resource's
fixup. With the kernel module loaded no intermediate is needed (a clone is made straight from
its template process and moved under the child's init), and once all exist each clone is moved
under the clone of its parent (REPARENT, while still stopped under ptrace), so the child's
process tree is the template's; without it, every clone stays a child of the child's init.
All ptrace work for one fork happens in the calling thread (REPARENT of a traced clone must
come from its tracer). Stopping the template's processes and letting them go is seize.py's.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import struct
import termios
import time
from dataclasses import dataclass, field
from typing import Callable

from .._core import PROTO, _syscalls
from .._core.kmod import FORK_MAX_CHILDREN, backend
from .._core.kmod import why as kmod_why
from ..compel import Tracee
from ..errors import BunshinError, ForkError
from . import nspool
from .plan import ProcPlan
from .remote import ANY_ERROR, Remote, enter_namespaces, set_affinity
from .seize import Pinned


CLONE_VM = 0x00000100
CLONE_PARENT = 0x00008000
CLONE_NS_ALL = 0x20000000 | 0x00020000 | 0x40000000 | 0x08000000 | 0x04000000  # pid mnt net ipc uts
_WALL = 0x40000000
_WNOHANG = 1
_HDR = struct.Struct("=IIQII")


def pid_max() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read())


def _nspid(hostpid: int) -> list[int]:
    with open(f"/proc/{hostpid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    raise ForkError(f"pid {hostpid} has no NSpid line", pid=hostpid)


@dataclass
class ForkCtx:
    """What the fixups of one child share."""

    init_hostpid: int
    plans: dict[int, ProcPlan]
    shared: dict = field(default_factory=dict)
    # template pid -> the CPUs its clone gets back in its fixups (with RUN; empty: the trainer
    # gives them back after, seize.Pinned.release_clone)
    cpus: dict[int, set[int]] = field(default_factory=dict)
    # the clones are made in the child's namespaces, root and cgroups already (FORK IN_PARENT):
    # their fixups neither setns nor move them
    in_child: bool = False


MAX_PID_NS_LEVEL = 32  # the kernel's limit on nested pid namespaces


def too_deep(template_init: int) -> bool:
    """Whether a child of this template would be past the kernel's nesting limit (the
    template's level is one less than its NSpid's length; a child's, one more)."""
    return len(_nspid(template_init)) > MAX_PID_NS_LEVEL


def check_depth(template_init: int) -> None:
    """A child's pid namespace is nested in its template's (clone3 can only go deeper), and the
    kernel stops at 32 levels. Every ws.fork()/ws.snapshot() moves the workspace one level
    down; forks of one template (tpl.fork, ws.restore(tpl)) do not."""
    if too_deep(template_init):
        level = len(_nspid(template_init)) - 1
        raise ForkError(
            f"this workspace is {level} pid namespaces deep, the kernel's limit is {MAX_PID_NS_LEVEL}: "
            "snapshot once (tpl = ws.snapshot()) and use tpl.fork() or ws.restore(tpl) instead of "
            "forking a fork of a fork", step="depth")


def clone_init(tinit: Tracee, tpl_sock: socket.socket, mount_fd: int, hostname: str,
               cgroup, pin: Pinned) -> tuple[Tracee, socket.socket]:
    """Clone the template's init into fresh namespaces and have it move into the child's root;
    returns the (running) child init and the trainer's end of its new control socket. Net, ipc
    and uts namespaces come ready-made from the pool when it has some (the init joins them).
    The init is let go on the CPUs other than the engine's, so that its move into the new
    root runs beside the clones made meanwhile, not in their place on the pinned CPU."""
    _wait_taken(tpl_sock)
    p = nspool.pool()
    made = p.take() if p is not None else None
    try:
        ci = tinit.clone(flags=CLONE_NS_ALL & ~nspool.POOLED if made else CLONE_NS_ALL)
    except BaseException:
        if made:
            made.close()
        raise
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        cgroup.add(ci.pid)
        payload = hostname.encode()
        fds = [mount_fd, theirs.fileno(), *(made.fds() if made else ())]
        msg = _HDR.pack(PROTO["REQ_REROOT"], 0, 0, len(payload), len(fds)) + payload
        # The template's init shares this socket but is stopped: only the clone reads it
        # (and, until it has, no other clone is made: _wait_taken).
        socket.send_fds(tpl_sock, [msg], fds)
        pin.release_clone(tinit.pid, ci, away=True)
        ci.detach()
    except BaseException:
        os.kill(ci.pid, signal.SIGKILL)
        ours.close()
        raise
    finally:
        theirs.close()
        if made:
            made.close()  # the child's init holds them now (or failed, and they go)
    return ci, ours


def _wait_taken(tpl_sock: socket.socket, timeout: float = 5.0) -> None:
    """Every init cloned from the template holds the template's end of this socket until its
    REROOT replaces it, so a new clone could take the message sent to the previous one (and
    each init would move into the other's root and answer the other's channel). A clone is
    therefore made only once every message sent is taken: nothing left in the socket's
    queue (SIOCOUTQ: bytes sent and not yet received)."""
    deadline = time.monotonic() + timeout
    buf = bytearray(4)
    delay = 0.00002
    while True:
        fcntl.ioctl(tpl_sock.fileno(), termios.TIOCOUTQ, buf)
        if not int.from_bytes(buf, "little"):
            return
        if time.monotonic() >= deadline:
            raise ForkError("the previous child's init did not take its start-up message within "
                            f"{timeout}s (killed before it ran?); this template cannot make another "
                            "child's init: close it and snapshot again", step="reroot")
        time.sleep(delay)
        delay = min(delay * 2, 0.005)


def clone_process(source: Callable[[], Tracee], proc: ProcPlan, child_inits: list[int],
                  tmp_pid: int, ahead: list[Tracee | None] | None = None,
                  sibling: bool = False) -> list[Tracee]:
    """Clone ``proc`` into each child's pid namespace (one per pid in ``child_inits``, the
    children's inits) with its own PID, parented to that child's init; returns the clones in
    that order. With the module's FORK the template process clones itself in the kernel, all
    children in one call. With REPARENT only, each clone is made straight from the template
    process and moved under the child's init. Without the module, an intermediate sharing the
    template's memory (CLONE_VM: nothing copied) is made in the child's namespace, the real
    clone is made from it, and the intermediate is killed, so its orphan is adopted by the
    child's init (the template process reaps the intermediate, or the kernel does when it is
    a ``sibling``, see make_mid); ``ahead[i]``, when there, is child
    i's intermediate made ahead (earlyinit.py), used (and ended) instead of a new one;
    ``sibling``: new ones are made so. On failure no clone is left, nor
    any of those intermediates.

    ``source()`` gives the template process, called only when it must run (it may thaw a
    held template). The intermediates are reaped before this returns: until then each is a
    zombie in the child's pid namespace (``ps`` there would show it) and cgroup (it takes a
    pid of the child's limit)."""
    b = backend()
    out: list[Tracee] = []
    mids: list[int] = []  # intermediates, as the template process sees them: reaped together
    ahead = list(ahead) if ahead is not None else [None] * len(child_inits)
    try:
        if b.fork is not None:  # one call per chunk of children
            for at in range(0, len(child_inits), FORK_MAX_CHILDREN):
                out += _fork_chunk(b.fork, source(), proc, child_inits[at:at + FORK_MAX_CHILDREN])
        else:
            for i, ci in enumerate(child_inits):
                if b.reparent is not None:
                    out.append(_clone_reparented(b.reparent, source(), proc, ci))
                    continue
                mid, ahead[i] = ahead[i], None
                out.append(_clone_through(source, proc, ci, tmp_pid, mids, mid, sibling))
        _end_unused(ahead, mids)  # none is left unused but by a backend that needs none
        if mids:
            reap_in(source(), mids)
    except BaseException:
        for c in out:
            discard_clone(c)
        _end_unused(ahead, mids)
        try:
            if mids:
                reap_in(source(), mids)
        except BunshinError:
            pass  # the template process is what failed: the fork says so already
        raise
    return out


def _end_unused(ahead: list[Tracee | None], mids: list[int]) -> None:
    for mid in ahead:
        if mid is not None:
            end_mid(mid, mids)
    ahead[:] = [None] * len(ahead)


def reap_in(tp: Tracee, pids: list[int]) -> None:
    """wait4 for each of ``pids`` (dead children of the template process) inside it: one stop
    for all (compel's batch in the page it keeps there), or one call when there is one."""
    if len(pids) == 1:
        tp.syscall(61, pids[0], 0, _WALL, 0)
    elif pids:
        for at in range(0, len(pids), Tracee.max_calls()):
            tp.calls([(61, (pid, 0, _WALL, 0), Tracee.BATCH_OK_ERR)
                      for pid in pids[at:at + Tracee.max_calls()]])


def make_mid(tp: Tracee, child_init: int, tmp_pid: int, sibling: bool = False) -> Tracee:
    """An intermediate for the clone of ``tp`` into the child whose init is ``child_init``:
    stopped, in that child's pid namespace as ``tmp_pid``, sharing ``tp``'s memory (nothing
    copied); a child of ``tp``, which must reap it (:func:`end_mid`, :func:`reap_in`).
    ``sibling`` (TemplateCore.mids_reap_themselves): a child of ``tp``'s parent instead, the
    template's init, which ignores SIGCHLD, so the kernel reaps it as it dies: nothing to
    inject into the template (nor to thaw it for)."""
    flags = CLONE_VM | (CLONE_PARENT if sibling else 0)
    return tp.clone(pidns_owner=child_init, set_tid=tmp_pid, flags=flags, quiet_exit=True)


def end_mid(mid: Tracee, mids: list[int]) -> None:
    """Kill an intermediate; its pid as its template process sees it goes into ``mids``, for
    :func:`reap_in` there. Until then its zombie holds a pid of the child's namespace, which
    therefore cannot end. One made as a ``sibling`` is gone once its tracer (we) has reaped
    it: the kernel hands it to its real parent, which ignores SIGCHLD, and releases it."""
    if not mid.clone_flags & CLONE_PARENT:
        mids.append(mid.in_parent)
    # Killing it while stopped: it never runs the template's code in shared memory.
    os.kill(mid.pid, signal.SIGKILL)
    os.waitpid(mid.pid, _WALL)  # as its tracer: hands the zombie to its real parent
    mid._ctl = None  # dead: nothing to cure or detach


def _clone_through(source: Callable[[], Tracee], proc: ProcPlan, child_init: int, tmp_pid: int,
                   mids: list[int], mid: Tracee | None = None, sibling: bool = False) -> Tracee:
    """The clone through an intermediate (``mid`` when one was made ahead); the dead
    intermediate goes into ``mids`` for the caller to reap, with the others of the call."""
    if mid is None:
        tp = source()
        try:
            mid = make_mid(tp, child_init, tmp_pid, sibling)
        except ForkError as e:
            raise _clone_failed(proc, "its intermediate", tmp_pid, e) from None
    try:
        return mid.clone(set_tid=proc.vpid, owe_robust=True)  # fix_process sets it
    except ForkError as e:
        raise _clone_failed(proc, "its clone", proc.vpid, e) from None
    finally:
        end_mid(mid, mids)


def _clone_failed(proc: ProcPlan, what: str, pid: int, e: ForkError) -> ForkError:
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


def _fork_chunk(k, tp: Tracee, proc: ProcPlan, inits: list[int]) -> list[Tracee]:
    """One FORK: the template process is resumed once, clones itself in the kernel into each
    child's namespace and stops again; no injected system call. With a module that can, each
    clone is made in its parent's (the child's init's) namespaces, root and cgroups: the
    inits must be in their roots (clones_in_child). A signal pending for it
    (EAGAIN: it would stop for that first) is taken by one injected no-op, which holds it
    back, and the call is made again."""
    want = [(ci, proc.vpid, ci) for ci in inits]
    in_parent = k.forks_in_parent
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


def _clone_reparented(k, tp: Tracee, proc: ProcPlan, child_init: int) -> Tracee:
    """One injected clone3 instead of two plus a kill and a wait: the clone's parent is the
    template process until REPARENT moves it, still stopped, under the child's init."""
    try:
        child = tp.clone(pidns_owner=child_init, set_tid=proc.vpid)
    except ForkError as e:
        raise _clone_failed(proc, "its clone", proc.vpid, e) from None
    try:
        k.reparent(child.pid, child_init, traced=True)
    except OSError as e:
        as_seen = child.in_parent
        os.kill(child.pid, signal.SIGKILL)
        os.waitpid(child.pid, _WALL)  # as its tracer: hands the zombie to its real parent
        child._ctl = None
        tp.syscall(61, as_seen, 0, _WALL, 0)  # wait4 in the template process, its parent
        raise ForkError(f"/dev/bunshin REPARENT of process {proc.vpid} ({proc.name}) under the "
                        f"child's init: {e.strerror}", pid=child.pid, step="reparent",
                        errno=e.errno) from None
    return child


def reparent_clones(plans: list[ProcPlan], clones: dict[int, Tracee]) -> int:
    """Put each clone (``{vpid: clone}``, all stopped and traced by this thread) under the clone
    of its template parent, when the module can (REPARENT); returns how many moved. Without it
    the clones stay children of the child's init: the user-space engine cannot do better."""
    k = backend().reparent
    if k is None:
        return 0
    moved = 0
    for proc in plans:
        parent = clones.get(proc.ppid)
        child = clones.get(proc.vpid)
        if parent is None or child is None:  # init's children (ppid 1) are already right
            continue
        try:
            k.reparent(child.pid, parent.pid, traced=True)
        except OSError as e:
            raise ForkError(f"/dev/bunshin REPARENT of process {proc.vpid} ({proc.name}) under "
                            f"{proc.ppid}: {e.strerror}", pid=child.pid, step="reparent",
                            errno=e.errno) from None
        moved += 1
    return moved


def join_sessions(plans: list[ProcPlan], clones: dict[int, Tracee]) -> int:
    """Put each clone (``{vpid: clone}``) that is not a session leader into the session of its
    session leader's clone and the group of its group leader's clone, when the module can
    (JOIN_SESSION); returns how many moved. Without it a clone keeps its template's session,
    outside the child's pid namespace. A process whose session or group leader is gone from
    the template (a `sh -c` that exited) keeps its own: there is nothing to join."""
    k = backend().join_session
    if k is None:
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
            raise ForkError(f"/dev/bunshin JOIN_SESSION of process {proc.vpid} ({proc.name}) into "
                            f"session {proc.sid}, group {proc.pgid}: {e.strerror}", pid=child.pid,
                            step="session", errno=e.errno) from None
        moved += 1
    return moved


def discard_clone(c: Tracee) -> None:
    """Kill a stopped clone of a failed fork and let go of it as its tracer: a traced zombie
    would keep its pid namespace (and the child's init) from ever finishing."""
    try:
        tids = c.threads()
    except BunshinError:
        tids = [c.pid]
    try:
        os.kill(c.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    # Threads first: a leader is reported only once its traced threads are reaped.
    pending = [t for t in tids if t != c.pid] + [c.pid]
    deadline = time.monotonic() + 5
    while pending and time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pending[0], _WALL | _WNOHANG)
        except ChildProcessError:
            done = pending[0]
        if done:
            pending.pop(0)
        else:
            time.sleep(0.001)
    c._ctl = None


def clones_in_child() -> bool:
    """Whether clone_process makes each clone in the child's namespaces, root and cgroups
    (FORK IN_PARENT): the child's init must be in its root before, and the clone's fixups
    leave out the setns and the cgroup move."""
    return backend().fork_in_parent is not None


def clones_through_intermediates() -> bool:
    """Whether clone_process uses the intermediates made ahead (earlyinit.make_mids): only
    without the module. A clone from one is born in its child's cgroup."""
    b = backend()
    return b.fork is None and b.reparent is None


def fixups_in_kernel() -> bool:
    """Whether a clone's queued fixups are made by the clone itself in the kernel (RUN)."""
    return backend().run is not None


def fix_process(ctx: ForkCtx, proc: ProcPlan, child: Tracee) -> None:
    """Everything after the clone: its CPUs (``ctx.cpus``: first, so that the threads it gets
    inherit them), namespaces, cwd, session, descriptors, threads."""
    r = Remote(child, f"process {proc.vpid} ({proc.name})", run=backend().run)
    try:
        # queued (remote.py): up to the flush these run in one stop, but for what needs a result
        cpus = ctx.cpus.get(proc.hostpid)
        if cpus:
            set_affinity(r, cpus)
        owed = child.take_owed_robust()
        if owed is not None:
            r.queue("set_robust_list", *owed)
        enter_namespaces(r, proc.cwd, setns=not ctx.in_child)
        if proc.sid == proc.vpid:
            r.queue("setsid")
        elif proc.pgid == proc.vpid:
            r.queue("setpgid", 0, 0)
        elif proc.pgid in ctx.plans:
            # a member of another's group (a pipeline's second process): its group leader's
            # clone, made before it (plans are in pid order), has made that group again here,
            # in the same (template's) session. Should it come later, the clone stays outside
            # a group as before (JOIN_SESSION, with the module, sets it anyway).
            r.queue("setpgid", 0, proc.pgid, ok_errnos=ANY_ERROR)
        for f in proc.fds:
            if f.dup_of is not None:  # dup()ed in the template: share the recreated file
                r.dup_same(f.dup_of, f)
            else:
                f.handler.fixup(ctx, proc, r, f)
        if len(proc.threads) > 1:  # before timers and signals, which may target a thread
            r.flush()  # the queue, before the Tracee is used directly
            child.clone_threads(ctx.shared["tracees"][proc.hostpid])
        from .resources import PROC_REGISTRY

        for ops in PROC_REGISTRY:
            ops.fixup_proc(ctx, proc, r)
        r.flush()
    finally:
        r.release()


def finish_child(ctx: ForkCtx) -> None:
    """Once every process is cloned and fixed: what the resources left for the end."""
    from .resources import PROC_REGISTRY

    for ops in PROC_REGISTRY:
        fin = getattr(ops, "finish", None)
        if fin is not None:
            fin(ctx)


def dev_shm_used(template_init: int) -> bool:
    """Whether the template's /dev/shm holds anything (it cannot change while it is frozen)."""
    return bool(os.listdir(f"/proc/{template_init}/root/dev/shm"))


def copy_dev_shm(template_init: int, child_init: int) -> None:
    """/dev/shm is workspace state (a tmpfs of its own): the child starts with a copy."""
    import subprocess

    subprocess.run(["cp", "-a", f"/proc/{template_init}/root/dev/shm/.",
                    f"/proc/{child_init}/root/dev/shm/"], check=True, capture_output=True)


def overlay_fd(lowers, upper, work) -> int:
    try:
        return _syscalls.overlay_mount_fd([str(p) for p in lowers], str(upper), str(work))
    except OSError as e:
        raise ForkError(f"cannot build the child's root from {len(lowers)} layers: {e}") from None
