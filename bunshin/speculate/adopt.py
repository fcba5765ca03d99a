"""Low-level moves shared by speculation blocks and the executor.

* :func:`adopt` makes a workspace take over a live fork of itself (the same swap as
  ``Workspace.restore``, without forking again): the user's ``Workspace`` object and its
  ``Shell`` objects keep working and now see the fork's state.
* :func:`mark` / :func:`unchanged` tell whether a workspace was used since it was forked, so a
  fork's state may replace it. Checked conservatively: the workspace's cgroup used no CPU time
  since (every tool call, shell command or process exit does) and nothing was written into it
  from the host (``Workspace.host_writes``). A wrong "changed" only costs a miss; a wrong
  "unchanged" cannot happen unless a state change used no CPU in the workspace and wrote no
  file.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..runtime.workspace import Workspace

__all__ = ["adopt", "cpu_ns", "mark", "unchanged"]

# ws -> (body id, settled cgroup CPU ns, host writes) when it was last forked
_marks: weakref.WeakKeyDictionary[Workspace, tuple[str, int, int]] = weakref.WeakKeyDictionary()


def adopt(ws: Workspace, kid: Workspace) -> None:
    """``ws`` becomes ``kid`` (a fork of ``ws`` or of any template); ``kid`` is spent, ``ws``'s
    previous processes are torn down. No tool call may run on either."""
    ws.adopt(kid)
    _marks.pop(ws, None)


def cpu_ns(ws: Workspace) -> int | None:
    """CPU time the workspace's cgroup used (ns), or None without the cpu controller."""
    return ws.cgroup.stats().cpu_usage_ns


def _settled_cpu(ws: Workspace, quiet: float = 0.02, limit: float = 0.3) -> int | None:
    """The cgroup's CPU time once it stopped moving for ``quiet`` s (a source's processes
    finish the calls a fork injected in them within a few ms)."""
    last = cpu_ns(ws)
    since = time.monotonic()
    end = since + limit
    while last is not None and time.monotonic() < end:
        time.sleep(0.004)
        now = cpu_ns(ws)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
    return last


def mark(ws: Workspace) -> None:
    """Record ``ws`` as it is right after a fork of it."""
    usage = _settled_cpu(ws)
    if usage is not None:
        _marks[ws] = (ws.body.id, usage, ws.host_writes)


def unchanged(ws: Workspace) -> bool:
    """Whether ``ws`` is still exactly as :func:`mark` saw it."""
    m = _marks.get(ws)
    if m is None or ws.closed:
        return False
    return m == (ws.body.id, cpu_ns(ws), ws.host_writes)
