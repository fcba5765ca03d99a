"""Pending signals: fork(2) starts the child with none, so the signals pending in the template
at the moment of the fork are raised again in the clone (their siginfo is not kept). A
template process stopped by a signal (kill -STOP, Ctrl-Z) has its clone stopped too: SIGCONT
resumes either."""

from __future__ import annotations

import signal
from types import SimpleNamespace


def _pending(hostpid: int) -> tuple[int, int]:
    """(shared, the main thread's own) pending signal masks, from one read of status (found
    by key, not parsed line by line: this runs for every process of every fork)."""
    with open(f"/proc/{hostpid}/status", "rb") as f:
        status = f.read()
    masks = []
    for key in (b"\nShdPnd:", b"\nSigPnd:"):
        at = status.find(key)
        masks.append(int(status[at + len(key):status.index(b"\n", at + 1)], 16) if at >= 0 else 0)
    return masks[0], masks[1]


def plan_proc(proc) -> None:
    pass  # read at fork time: the template may have been signalled since the snapshot


def fixup_proc(ctx, proc, r) -> None:
    if proc.group_stopped:
        # SIGSTOP whatever stopped the template process: the job-control stops (SIGTSTP...)
        # do nothing in an orphaned process group, which the clone's may be where the
        # template's is not (a clone keeps its template's session without the module).
        # Held while the clone is traced, it stops it once let go; its parent sees that stop.
        r.call("kill", proc.vpid, signal.SIGSTOP)
    shared, private = _pending(proc.hostpid)
    if not (shared or private):
        return
    for sig in range(1, 65):
        bit = 1 << (sig - 1)
        if shared & bit:
            r.call("kill", proc.vpid, sig)
        elif private & bit:
            r.call("tgkill", proc.vpid, proc.vpid, sig)


OPS = SimpleNamespace(kind="pending-signals", plan_proc=plan_proc, fixup_proc=fixup_proc)
