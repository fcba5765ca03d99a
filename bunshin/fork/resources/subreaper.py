"""PR_SET_CHILD_SUBREAPER: a fork(2) child is not a subreaper, whatever its parent is, so a
clone of a template process that is one becomes one again. /proc does not show it: it is
asked of the template (prctl(PR_GET_CHILD_SUBREAPER), injected) on the first fork."""

from __future__ import annotations

from types import SimpleNamespace

from ...errors import ForkError

_SYS_PRCTL = 157
_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37


def plan_proc(proc) -> None:
    proc.subreaper = None  # asked of the template on the first fork


def _is_subreaper(proc, src) -> bool:
    page = src.page()  # the template's batch page (its clone mapped it): no mapping of ours
    addr = page[0] if page is not None else src.mmap(4096)
    try:
        got = src.syscall(_SYS_PRCTL, _PR_GET_CHILD_SUBREAPER, addr)
        if got != 0:
            raise ForkError(f"process {proc.vpid} ({proc.name}): prctl(PR_GET_CHILD_SUBREAPER) "
                            f"failed ({got})", pid=proc.hostpid, step="subreaper")
        return src.read(addr, 4) != bytes(4)
    finally:
        if page is None:
            src.munmap(addr, 4096)


def fixup_proc(ctx, proc, r) -> None:
    if proc.subreaper is None:
        proc.subreaper = _is_subreaper(proc, ctx.shared["tracees"][proc.hostpid])
    if proc.subreaper:
        r.queue("prctl", _PR_SET_CHILD_SUBREAPER, 1)


OPS = SimpleNamespace(kind="subreaper", plan_proc=plan_proc, fixup_proc=fixup_proc)
