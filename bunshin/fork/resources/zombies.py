"""Zombies: a child that exited and that its parent has not waited for yet. It holds its pid,
its exit status and its place among its parent's children, and nothing else (no memory, no
descriptors), so its parent's clone gets one again: the cgroup does not list it, so the plan
finds it among the children of each template process (/proc/PID/task/TID/children), with its
status (/proc/PID/stat, exit_code: the wait status). wait()/waitid() in the parent's clone then
returns what it returns in the template.

Once the child's process tree and sessions are made (REPARENT, JOIN_SESSION), the parent's
clone, stopped in the child's namespaces, forks a task with the zombie's pid (injected clone3
with set_tid), which inherits the parent's process group and session as the zombie had; that
task ends at once with the zombie's status, without running an instruction of its own: it
calls exit_group(N) injected, or dies of the zombie's signal at its first return to user space
(its default action, the signal unblocked, no core dump). We reap it as its tracer only, which
hands it to its parent, where it stays. Its death queues a SIGCHLD in the parent's clone that
the template process does not have: the clone takes it out again (rt_sigtimedwait) unless one
was pending in the template too.

Refused at plan time: a zombie whose status says it dumped core (a clone cannot dump one
without writing a core file), one made with another exit signal than SIGCHLD (clone3 here
sends SIGCHLD, and wait() tells them apart), one in a pid namespace below the workspace's, and
a parent that ignores SIGCHLD (its zombie would be reaped by the kernel as it is made).
Zombies of the init (a tool call that has just ended) are its own to reap: not carried."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import time
from dataclasses import dataclass
from types import SimpleNamespace

from ...errors import ForkError
from ...runtime.userns import inside
from ..plan import status_of
from .signals import PTRACE_CONT, ptrace, set_sigmask, sigmask

_SYS_RT_SIGACTION, _SYS_SETPGID, _SYS_SETSID, _SYS_RT_SIGTIMEDWAIT = 13, 109, 112, 128
_SYS_PRCTL, _SYS_EXIT_GROUP = 157, 231
_SYS_SETRESUID, _SYS_SETRESGID = 117, 119
_PR_SET_DUMPABLE = 4
_CLONE_VM = 0x00000100
_WALL = 0x40000000
_SIGCHLD_BIT = 1 << (signal.SIGCHLD - 1)



@dataclass
class Zombie:
    """A dead child of a template process, as its parent's clone must get it again."""

    vpid: int
    pgid: int
    sid: int
    status: int  # as wait() gives it: exit code << 8, or the signal that killed it
    ids: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())  # its real, effective, saved uids and gids


def _stat(hostpid: int) -> list[bytes]:
    """/proc/PID/stat's fields after the comm (the state is the first)."""
    with open(f"/proc/{hostpid}/stat", "rb") as f:
        raw = f.read()
    return raw[raw.rindex(b")") + 2:].split()


def _status(hostpid: int) -> dict[str, str]:
    with open(f"/proc/{hostpid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _children(proc) -> list[int]:
    """Host pids of the children of every thread of a (stopped) process."""
    out: list[int] = []
    for tid in proc.threads:
        try:
            with open(f"/proc/{proc.hostpid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
        except FileNotFoundError:
            continue
    return out


def _what(proc, vpid: int) -> str:
    return f"process {proc.vpid} ({proc.name}): its zombie child {vpid}"


def _zombie(proc, hostpid: int, level: int) -> Zombie | None:
    """The zombie at ``hostpid``, a child of ``proc``; None when it is not one (any more)."""
    try:
        fields = _stat(hostpid)
        if fields[0] != b"Z":
            return None
        st = _status(hostpid)
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return None
    nspid = st["NSpid"].split()
    vpid = int(nspid[-1])
    code, exit_signal = int(fields[49]), int(fields[35])  # stat's fields 52 and 38
    if len(nspid) != level:
        raise ForkError(f"{_what(proc, vpid)} is in a pid namespace of its own, which a fork does "
                        "not make again", pid=proc.hostpid, step="plan")
    if code & 0x80:
        raise ForkError(f"{_what(proc, vpid)} dumped core when it was killed by signal {code & 0x7F}: "
                        "its clone could not say so without dumping a core of its own; wait for it "
                        "before forking", pid=proc.hostpid, step="plan")
    if exit_signal != signal.SIGCHLD:
        raise ForkError(f"{_what(proc, vpid)} was made with exit signal {exit_signal} (clone()), not "
                        "SIGCHLD, which a fork does not make again; wait for it before forking",
                        pid=proc.hostpid, step="plan")
    return Zombie(vpid=vpid, pgid=int(st["NSpgid"].split()[-1]), sid=int(st["NSsid"].split()[-1]),
                  status=code, ids=(tuple(int(x) for x in st["Uid"].split()[:3]),
                                    tuple(int(x) for x in st["Gid"].split()[:3])))


def check_tree(procs) -> None:
    """Each process's zombies, into ``proc.zombies``; refuses those that cannot be made."""
    planned = {p.hostpid for p in procs}
    level = len(status_of(procs[0])["NSpid"].split()) if procs else 0
    for p in procs:
        p.zombies = []
        if p.is_init:
            continue
        for c in _children(p):
            if c in planned:
                continue
            z = _zombie(p, c, level)
            if z is not None:
                p.zombies.append(z)
        if not p.zombies:
            continue
        st = status_of(p)
        if int(st["SigIgn"], 16) & _SIGCHLD_BIT:
            raise ForkError(f"{_what(p, p.zombies[0].vpid)}: the process ignores SIGCHLD, so the "
                            "kernel would reap a zombie of its clone as it is made; wait for it "
                            "before forking", pid=p.hostpid, step="plan")
        # A SIGCHLD on the main thread's own queue, none on the process's: the one the new
        # zombie queues could not be told from it when the clone takes it out again.
        own, shared = int(st["SigPnd"], 16), int(st["ShdPnd"], 16)
        if own & _SIGCHLD_BIT and not shared & _SIGCHLD_BIT:
            raise ForkError(f"{_what(p, p.zombies[0].vpid)}: a SIGCHLD is pending on the process's "
                            "main thread alone, which its clone could not keep apart from the one "
                            "its zombie's death sends", pid=p.hostpid, step="plan")
        p.sigchld_pending = bool(shared & _SIGCHLD_BIT)


def plan_proc(proc) -> None:
    """Nothing more than check_tree found."""


def fixup_proc(ctx, proc, r) -> None:
    if proc.zombies:  # the parent's clone, for finish(): the queue so far runs first
        ctx.shared.setdefault("zombie-parents", []).append((proc, r.t))


def finish(ctx) -> None:
    for proc, clone in ctx.shared.pop("zombie-parents", []):
        _make_all(ctx, proc, clone)


def _make_all(ctx, proc, clone) -> None:
    """Every zombie of ``proc`` made again under its clone (stopped, traced). Every signal is
    blocked there meanwhile: the SIGCHLD their deaths queue must stay queued until the clone
    drops it, and the signals already queued again (signals.py) where they are, in their order
    (one taken during an injection would be held back and queued again after it)."""
    mask = sigmask(clone.pid, "zombies")
    set_sigmask(clone.pid, (1 << 64) - 1, "zombies")
    try:
        for z in proc.zombies:
            _make(ctx, proc, clone, z)
        if not proc.sigchld_pending:
            _drop_sigchld(proc, clone)
    finally:
        set_sigmask(clone.pid, mask, "zombies")


def _drop_sigchld(proc, clone) -> None:
    with clone.scratch() as addr:
        clone.write(addr, _SIGCHLD_BIT.to_bytes(8, "little") + bytes(16))  # the set, a zero timeout
        got = clone.syscall(_SYS_RT_SIGTIMEDWAIT, addr, 0, addr + 8, 8)
    if got != signal.SIGCHLD:
        raise ForkError(f"process {proc.vpid} ({proc.name}): its clone did not get the SIGCHLD of its "
                        f"zombies ({got})", pid=clone.pid, step="zombies")


def _make(ctx, proc, clone, z: Zombie) -> None:
    what = _what(proc, z.vpid)
    sig = z.status & 0x7F
    # An exit shares the parent's memory (nothing copied, nothing written there); a signal's
    # death needs its disposition and dumpability set, in memory of its own.
    flags = _CLONE_VM if not sig or sig == signal.SIGKILL else 0
    try:
        t = clone.clone(pidns_owner=ctx.init_hostpid, set_tid=z.vpid, flags=flags, owe_robust=True)
    except ForkError as e:
        raise ForkError(f"{what} could not be made again in the child: {e}", pid=clone.pid,
                        step="zombies", errno=e.errno) from None
    try:
        _join_group(t, proc, z, what)
        if proc.transplanted:
            _take_ids(t, z)
        if sig:
            status = _die_of(t, sig, what)
        else:
            status = _exit_with(t, z.status >> 8)
    except BaseException:
        _discard(t)
        raise
    t._ctl = None  # dead, and reaped as its tracer: nothing to cure or detach
    try:
        fields = _stat(t.pid)
    except (FileNotFoundError, ProcessLookupError):
        fields = []
    if fields and (fields[0] != b"Z" or int(fields[49]) != z.status or status != z.status):
        raise ForkError(f"{what} was made again with wait status {status:#x}, not {z.status:#x}",
                        pid=clone.pid, step="zombies")
    if not fields:
        raise ForkError(f"{what} was reaped as soon as it was made again: the process reaps its "
                        "children automatically (SA_NOCLDWAIT); wait for it before forking",
                        pid=clone.pid, step="zombies")


def _join_group(t, proc, z: Zombie, what: str) -> None:
    """The zombie's session and group where they are not its parent's (it left them)."""
    if z.sid == z.vpid and z.sid != proc.sid:
        got = t.syscall(_SYS_SETSID)
    elif z.pgid == z.vpid and z.pgid != proc.pgid:
        got = t.syscall(_SYS_SETPGID, 0, 0)
    elif z.pgid != proc.pgid:
        t.syscall(_SYS_SETPGID, 0, z.pgid)  # as fix_process: stays in its parent's if it cannot
        return
    else:
        return
    if -4096 < got < 0:
        raise ForkError(f"{what}: its session or group: {os.strerror(-got)}", pid=t.pid, step="zombies")


def _take_ids(t, z: Zombie) -> None:
    """The zombie's uids and gids, which /proc shows, for a zombie of a transplant (made while
    it is root, fork/transplant.py). Not for a clone's: a change of ids resets the dumpability
    of the memory an exiting zombie shares with its parent, which a transplant sets after."""
    uids, gids = z.ids
    for nr, ids in ((_SYS_SETRESGID, inside(t.pid, "gid", gids)), (_SYS_SETRESUID, inside(t.pid, "uid", uids))):
        got = t.syscall(nr, *ids)
        if got:
            raise ForkError(f"pid {t.pid}: a zombie's ids {ids}: {os.strerror(-got)}", pid=t.pid,
                            step="zombies", errno=-got)


def _exit_with(t, code: int) -> int:
    """exit_group(code) injected; compel reaps the dead task as its tracer (ESRCH)."""
    try:
        t.syscall(_SYS_EXIT_GROUP, code)
    except ForkError as e:
        if e.errno != errno.ESRCH:
            raise
        return code << 8
    raise ForkError(f"pid {t.pid}: exit_group({code}) returned", pid=t.pid, step="zombies")


def _die_of(t, sig: int, what: str) -> int:
    """The task killed by ``sig`` before it runs an instruction, reaped as its tracer; returns
    its wait status."""
    if sig != signal.SIGKILL:
        with t.scratch() as addr:
            t.write(addr, bytes(32))  # SIG_DFL, no flags, no mask
            for nr, args in ((_SYS_RT_SIGACTION, (sig, addr, 0, 8)), (_SYS_PRCTL, (_PR_SET_DUMPABLE, 0))):
                got = t.syscall(nr, *args)
                if got < 0:
                    raise ForkError(f"{what}: syscall {nr}: {os.strerror(-got)}", pid=t.pid, step="zombies")
        set_sigmask(t.pid, 0, "zombies")
    os.kill(t.pid, sig)
    deadline = time.monotonic() + 5
    while True:
        if sig != signal.SIGKILL:  # SIGKILL ends a stopped task at once; the others on delivery
            with contextlib.suppress(ForkError):  # gone already: the wait says how
                ptrace(PTRACE_CONT, t.pid, None, None, "PTRACE_CONT", "zombies")
        done, st = os.waitpid(t.pid, _WALL)
        if not os.WIFSTOPPED(st):
            return st
        if os.WSTOPSIG(st) == sig:  # its delivery stop: let it go with the signal
            ptrace(PTRACE_CONT, t.pid, None, ctypes.c_void_p(sig), "PTRACE_CONT", "zombies")
            _, st = os.waitpid(t.pid, _WALL)
            return st
        if time.monotonic() > deadline:
            raise ForkError(f"{what}: did not die of signal {sig} (stopped for {st:#x})", pid=t.pid,
                            step="zombies")


def _discard(t) -> None:
    """A half-made zombie of a failed fork: killed, reaped as its tracer (the fork's abort
    kills its parent's clone, which takes the rest)."""
    try:
        os.kill(t.pid, signal.SIGKILL)
        os.waitpid(t.pid, _WALL)
    except (ProcessLookupError, ChildProcessError):
        pass
    t._ctl = None


OPS = SimpleNamespace(kind="zombies", plan_proc=plan_proc, fixup_proc=fixup_proc, check_tree=check_tree,
                      finish=finish)
