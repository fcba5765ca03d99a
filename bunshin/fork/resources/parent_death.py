"""PR_SET_PDEATHSIG: the signal a process gets when its parent ends. fork(2) clears it, so a
clone of a template process that set one sets it again. /proc does not show it: subreaper.ask
asks it of the template on the first fork, with the subreaper flag.

It is a thread's, and so is the parent it watches (the thread that forked it). The main
thread's is asked with the subreaper flag; each other thread's by a prctl injected in that
thread of the template (as compel reads its alternate signal stack to clone it, and after
it), once per template: a frozen template sets none again. A clone's thread made again by
compel sets its own with one injected prctl, where it is not 0. A clone's parent is the clone
of its template process's parent (moved under it with REPARENT; made by it without the
module, tree.py), as in the template; in a flat tree (BUNSHIN_TREE=flat, or a deviation
tree.py names) it is the child's init, so the signal comes when that init ends, with the
child workspace."""

from __future__ import annotations

from types import SimpleNamespace

from ...errors import ForkError
from .threads import vtid

_SYS_PRCTL = 157
_PR_SET_PDEATHSIG, _PR_GET_PDEATHSIG = 1, 2


def plan_proc(proc) -> None:
    """subreaper.plan_proc leaves the main thread's to be asked; the others' are asked by the
    first clone's fixups (_ask_threads)."""
    proc.thread_pdeath = None  # {vtid: signal} of the threads but the main one with one


def _fail(proc, tid: int, what: str, got: int) -> ForkError:
    return ForkError(f"process {proc.vpid} ({proc.name}) thread {tid}: {what} failed ({got})",
                     pid=proc.hostpid, step="parent-death")


def _ask_threads(ctx, proc) -> dict[int, int]:
    """Each thread's but the main one, by a prctl injected in that thread of the template. Only
    once its clone's threads are made (engine.fix_process): an injected call takes a signal
    pending for the thread (held until the template is let go), which /proc then no longer
    shows, and so a thread's clone made after would lack it (compel reads the thread's state,
    its pending signals with it, before its own injection in it, the alternate stack's)."""
    tp = ctx.shared["tracees"][proc.hostpid]
    found = {}
    with tp.scratch() as addr:
        for tid in proc.threads[1:]:
            got = tp.thread_syscall(tid, _SYS_PRCTL, _PR_GET_PDEATHSIG, addr)
            if got != 0:
                raise _fail(proc, proc.thread_vtids[tid], "prctl(PR_GET_PDEATHSIG)", got)
            sig = int.from_bytes(tp.read(addr, 4), "little")
            if sig:
                found[proc.thread_vtids[tid]] = sig
    if found and proc.transplanted:
        # its threads take its uid after every fixup (transplant.set_credentials), and a change
        # of credentials clears each one's parent-death signal
        vtid, sig = next(iter(found.items()))
        raise ForkError(f"process {proc.vpid} ({proc.name}) thread {vtid}: a parent-death signal "
                        f"({sig}) set by a thread other than the main one of a process under "
                        "another uid cannot be carried: its transplant's threads take that uid "
                        "last, which clears it", pid=proc.hostpid, step="parent-death")
    return found


def fixup_proc(ctx, proc, r) -> None:
    if proc.pdeath_signal:
        r.queue("prctl", _PR_SET_PDEATHSIG, proc.pdeath_signal)
    if len(proc.threads) < 2:
        return
    if proc.thread_pdeath is None:
        proc.thread_pdeath = _ask_threads(ctx, proc)
    if not proc.thread_pdeath:
        return
    child = r.t  # the queue first
    by_vtid = {vtid(child.pid, t): t for t in child.threads()[1:]}
    for v, sig in proc.thread_pdeath.items():
        got = child.thread_syscall(by_vtid[v], _SYS_PRCTL, _PR_SET_PDEATHSIG, sig)
        if got != 0:
            raise _fail(proc, v, f"prctl(PR_SET_PDEATHSIG, {sig}) in its clone", got)


OPS = SimpleNamespace(kind="parent-death-signal", plan_proc=plan_proc, fixup_proc=fixup_proc)
