"""PR_SET_CHILD_SUBREAPER: a fork(2) child is not a subreaper, whatever its parent is, so a
clone of a template process that is one becomes one again. /proc does not show it: it is
asked of the template (prctl(PR_GET_CHILD_SUBREAPER), injected) on the first fork, in the same
stop as its parent-death signal (parent_death.py), which /proc does not show either."""

from __future__ import annotations

from types import SimpleNamespace

from ...compel import Tracee
from ...errors import ForkError

_SYS_PRCTL = 157
_PR_GET_PDEATHSIG = 2
_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37


def plan_proc(proc) -> None:
    proc.subreaper = None  # asked of the template on the first fork (ask)
    proc.pdeath_signal = None


def ask(proc, src) -> None:
    """``proc.subreaper`` and ``proc.pdeath_signal``, asked of the template process ``src``
    (its main thread's: the parent-death signal is a thread's) in one stop."""
    with src.scratch() as addr:
        got = src.calls([(_SYS_PRCTL, (_PR_GET_CHILD_SUBREAPER, addr), Tracee.BATCH_OK_ERR),
                         (_SYS_PRCTL, (_PR_GET_PDEATHSIG, addr + 4), Tracee.BATCH_OK_ERR)])
        values = src.read(addr, 8)
    if any(g != 0 for g in got):
        raise ForkError(f"process {proc.vpid} ({proc.name}): prctl(PR_GET_CHILD_SUBREAPER, "
                        f"PR_GET_PDEATHSIG) failed ({got})", pid=proc.hostpid, step="subreaper")
    proc.subreaper = values[:4] != bytes(4)
    proc.pdeath_signal = int.from_bytes(values[4:], "little")


def fixup_proc(ctx, proc, r) -> None:
    if proc.subreaper is None:
        ask(proc, ctx.shared["tracees"][proc.hostpid])
    if proc.subreaper:
        r.queue("prctl", _PR_SET_CHILD_SUBREAPER, 1)


OPS = SimpleNamespace(kind="subreaper", plan_proc=plan_proc, fixup_proc=fixup_proc)
