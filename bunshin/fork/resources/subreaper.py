"""PR_SET_CHILD_SUBREAPER: a fork(2) child is not a subreaper, whatever its parent is, so a
clone of a template process that is one becomes one again. /proc does not show it: it is
asked of the template (prctl(PR_GET_CHILD_SUBREAPER), injected) on the first fork, with its
parent-death signal (parent_death.py), which /proc does not show either (questions.py)."""

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


def ask(ctx, proc, q) -> None:
    """``proc.subreaper`` and ``proc.pdeath_signal``, asked of the template process (its main
    thread's: the parent-death signal is a thread's), once."""
    if proc.subreaper is not None:
        return

    def build(addr: int, first: int):
        return [(_SYS_PRCTL, (_PR_GET_CHILD_SUBREAPER, addr), Tracee.BATCH_OK_ERR),
                (_SYS_PRCTL, (_PR_GET_PDEATHSIG, addr + 4), Tracee.BATCH_OK_ERR)]

    def answer(got: list[int], values: bytes) -> None:
        if len(got) < 2 or any(g != 0 for g in got):
            raise ForkError(f"process {proc.vpid} ({proc.name}): prctl(PR_GET_CHILD_SUBREAPER, "
                            f"PR_GET_PDEATHSIG) failed ({got})", pid=proc.hostpid, step="subreaper")
        proc.subreaper = values[:4] != bytes(4)
        proc.pdeath_signal = int.from_bytes(values[4:], "little")

    q.ask(8, build, answer)


def fixup_proc(ctx, proc, r) -> None:
    if proc.subreaper:
        r.queue("prctl", _PR_SET_CHILD_SUBREAPER, 1)


OPS = SimpleNamespace(kind="subreaper", plan_proc=plan_proc, ask=ask, fixup_proc=fixup_proc)
