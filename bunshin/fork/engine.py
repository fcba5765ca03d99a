"""The fixup half of a fork, and the loop over it.

Per child: a detached overlay root is built from the template's layers; the template's init
is cloned into new pid/mnt/net/ipc/uts namespaces and told (REROOT) to move into that root;
every other process is cloned into the child's pid namespace with its own PID by the fork's
Cloner (cloners.py: through an intermediate without the kernel module, in the kernel with it),
its parent the child's init, or, without the module, its parent's clone (tree.py); then each
clone joins the child's namespaces and every descriptor is recreated by its resource's fixup.
Once all exist the Cloner makes the child's process tree and sessions the template's where the
module can.
All ptrace work for one fork happens in the calling thread (REPARENT of a traced clone must
come from its tracer). Stopping the template's processes and letting them go is seize.py's.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import struct
import termios
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .._core import PROTO, _syscalls
from ..compel import Tracee
from ..errors import BunshinError, ForkError
from . import nspool
from .plan import ProcPlan
from .remote import ANY_ERROR, enter_namespaces, set_affinity
from .seize import Pinned

if TYPE_CHECKING:
    from .cloners import Cloner


CLONE_VM = 0x00000100
CLONE_PARENT = 0x00008000
CLONE_NS_ALL = 0x20000000 | 0x00020000 | 0x40000000 | 0x08000000 | 0x04000000  # pid mnt net ipc uts
WALL = 0x40000000
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
    cloner: Cloner  # the fork's: where its clones are born, where their fixups run
    shared: dict = field(default_factory=dict)
    # template pid -> the CPUs its clone gets back in its fixups (with RUN; empty: the trainer
    # gives them back after, seize.Pinned.release_clone)
    cpus: dict[int, set[int]] = field(default_factory=dict)


MAX_PID_NS_LEVEL = 32  # the kernel's limit on nested pid namespaces


def too_deep(template_init: int, below: int = 1) -> bool:
    """Whether a workspace ``below`` levels under this template would be past the kernel's
    nesting limit (the template's level is one less than its NSpid's length)."""
    return len(_nspid(template_init)) - 1 + below > MAX_PID_NS_LEVEL


def check_depth(template_init: int) -> None:
    """A child's pid namespace is nested in its template's (clone3 can only go deeper), and the
    kernel stops at 32 levels. A fork of a fork goes one level deeper (ws.restore(tpl), a
    speculation's commit: the workspace becomes a fork); forks of one template do not."""
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
    ci, made = clone_init_unrooted(tinit, cgroup, pin)
    return ci, reroot(ci, tpl_sock, mount_fd, hostname, made)


def clone_init_unrooted(tinit: Tracee, cgroup, pin: Pinned) -> tuple[Tracee, nspool.NsSet | None]:
    """The first half of :func:`clone_init`: the child's init in ``cgroup``, stopped until
    :func:`reroot` (given the pooled namespaces returned, which it then owns) sends it its
    root, which need not exist yet."""
    p = nspool.pool_for(tinit.pid)
    made = p.take() if p is not None else None
    try:
        ci = tinit.clone(flags=CLONE_NS_ALL & ~nspool.POOLED if made else CLONE_NS_ALL)
    except BaseException:
        if made:
            made.close()
        raise
    try:
        cgroup.add(ci.pid)
        pin.release_clone(tinit.pid, ci, away=True)
    except BaseException:
        discard_clone(ci)
        if made:
            made.close()
        raise
    return ci, made


def reroot(ci: Tracee, tpl_sock: socket.socket, mount_fd: int, hostname: str,
           made: nspool.NsSet | None) -> socket.socket:
    """Send the child's init cloned by :func:`clone_init_unrooted` its root (``mount_fd``
    stays the caller's), hostname, new control socket and pooled namespaces (``made``,
    closed here), and let it run; returns the trainer's end of that socket. The template's
    init shares this socket but is stopped: only the clone reads it, and it runs only once
    every message sent before is taken (_wait_taken), so that it reads its own first. On
    failure the init is killed."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        _wait_taken(tpl_sock)
        payload = hostname.encode()
        fds = [mount_fd, theirs.fileno(), *(made.fds() if made else ())]
        msg = _HDR.pack(PROTO["REQ_REROOT"], 0, 0, len(payload), len(fds)) + payload
        socket.send_fds(tpl_sock, [msg], fds)
        ci.detach()
    except BaseException:
        discard_clone(ci)
        ours.close()
        raise
    finally:
        theirs.close()
        if made:
            made.close()  # the child's init holds them now (or failed, and they go)
    return ours


def _wait_taken(tpl_sock: socket.socket, timeout: float = 5.0) -> None:
    """Every init cloned from the template holds the template's end of this socket until its
    REROOT replaces it, so a new clone could take the message sent to the previous one (and
    each init would move into the other's root and answer the other's channel). A clone is
    therefore let run only once every message sent is taken: nothing left in the socket's
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


def reap_in(tp: Tracee, pids: list[int]) -> None:
    """wait4 for each of ``pids`` (dead children of the template process) inside it: one stop
    for all (compel's batch in the page it keeps there), or one call when there is one.
    Cannot block: each is a zombie already (end_mid saw it die, as its tracer)."""
    if len(pids) == 1:
        tp.syscall(61, pids[0], 0, WALL, 0)
    elif pids:
        for at in range(0, len(pids), Tracee.max_calls()):
            tp.calls([(61, (pid, 0, WALL, 0), Tracee.BATCH_OK_ERR)
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
    # as its tracer: hands the zombie to its real parent. Cannot block: SIGKILL ends a
    # ptrace-stopped single-threaded task at once.
    os.waitpid(mid.pid, WALL)
    mid._ctl = None  # dead: nothing to cure or detach


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
            done, _ = os.waitpid(pending[0], WALL | _WNOHANG)
        except ChildProcessError:
            done = pending[0]
        if done:
            pending.pop(0)
        else:
            time.sleep(0.001)
    c._ctl = None


def fix_process(ctx: ForkCtx, proc: ProcPlan, child: Tracee) -> None:
    """Everything after the clone: its CPUs (``ctx.cpus``: first, so that the threads it gets
    inherit them), namespaces, cwd, session, descriptors, threads; the template process's
    answers to its questions are in (resources.ask_template)."""
    from .resources import PROC_REGISTRY

    r = ctx.cloner.remote(child, f"process {proc.vpid} ({proc.name})")
    try:
        # queued (remote.py): up to the flush these run in one stop, but for what needs a result
        cpus = ctx.cpus.get(proc.hostpid)
        if cpus:
            set_affinity(r, cpus)
        owed = child.take_owed_robust()
        if owed is not None:
            r.queue("set_robust_list", *owed)
        enter_namespaces(r, proc.cwd, setns=not ctx.cloner.in_child)
        if proc.vpid in ctx.shared.get("tree-led", ()):  # tree.LED
            pass  # in its session and group since before its children were made (tree.py)
        elif proc.sid == proc.vpid:
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
                assert f.handler is not None  # plan_tree gave every descriptor one
                f.handler.fixup(ctx, proc, r, f)
        if len(proc.threads) > 1:  # before timers and signals, which may target a thread
            r.flush()  # the queue, before the Tracee is used directly
            child.clone_threads(ctx.shared["tracees"][proc.hostpid])
        for ops in PROC_REGISTRY:
            ops.fixup_proc(ctx, proc, r)
        ctx.cloner.after_fixups(ctx, proc, child)
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
    ctx.cloner.finish_child(ctx)


def dev_shm_used(template_init: int) -> bool:
    """Whether the template's /dev/shm holds anything (it cannot change while it is frozen)."""
    return bool(os.listdir(f"/proc/{template_init}/root/dev/shm"))


def copy_dev_shm(template_init: int, child_init: int) -> None:
    """/dev/shm is workspace state (a tmpfs of its own): the child starts with a copy."""
    import subprocess

    # A sandbox's /dev/shm belongs to its user namespace, where host root is nobody and may
    # make no file: the copy is made as that namespace's root.
    as_root = ([] if os.stat(f"/proc/{child_init}/ns/user").st_ino == os.stat("/proc/self/ns/user").st_ino
               else ["nsenter", f"--user=/proc/{child_init}/ns/user", "--setuid=0", "--setgid=0"])
    subprocess.run([*as_root, "cp", "-a", f"/proc/{template_init}/root/dev/shm/.",
                    f"/proc/{child_init}/root/dev/shm/"], check=True, capture_output=True)


def overlay_fd(lowers, upper, work, userns=None) -> int:
    """A child's root, detached. ``userns`` (runtime/userns.py, a sandbox workspace's): the
    rootfs's layers through its idmapped views, and the new upper layer owned by its root."""
    try:
        if userns is not None:
            lowers = userns.layers(lowers)
            userns.give_dirs(upper, work)
        return _syscalls.overlay_mount_fd([str(p) for p in lowers], str(upper), str(work))
    except OSError as e:
        raise ForkError(f"cannot build the child's root from {len(lowers)} layers: {e}") from None
