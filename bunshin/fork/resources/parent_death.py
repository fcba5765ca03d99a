"""PR_SET_PDEATHSIG: the signal a process gets when its parent ends. fork(2) clears it, so a
clone of a template process that set one sets it again. /proc does not show it: subreaper.ask
asks it of the template on the first fork, with the subreaper flag.

It is a thread's, and so is the parent it watches (the thread that forked it): the main
thread's is carried. A clone's parent is the clone of its template process's parent (moved
under it with REPARENT; made by it without the module, tree.py), as in the template; in a flat
tree (BUNSHIN_TREE=flat, or a deviation tree.py names) it is the child's init, so the signal
comes when that init ends, with the child workspace."""

from __future__ import annotations

from types import SimpleNamespace

_PR_SET_PDEATHSIG = 1


def plan_proc(proc) -> None:
    """subreaper.plan_proc leaves it to be asked."""


def fixup_proc(ctx, proc, r) -> None:
    if proc.pdeath_signal:
        r.queue("prctl", _PR_SET_PDEATHSIG, proc.pdeath_signal)


OPS = SimpleNamespace(kind="parent-death-signal", plan_proc=plan_proc, fixup_proc=fixup_proc)
