"""Low-level moves shared by speculation blocks and the executor.

* :func:`adopt` makes a workspace take over a live fork of its own template (the same swap as
  ``Workspace.restore``, without forking again): the user's ``Workspace`` object and its
  ``Shell`` objects keep working and now see the fork's state.
* :func:`mark_clean` / :func:`clean_template` remember that a workspace is a *fresh* fork of its
  template, so the next speculation can fork from that template instead of snapshotting again
  (every snapshot moves the workspace one pid namespace deeper; the kernel stops at 32).
  "Fresh" is checked conservatively: the workspace's cgroup used no CPU time since (every tool
  call, shell command or process exit does) and its upper layer is still empty (no file written
  from the host). A wrong "dirty" only costs a snapshot; a wrong "clean" cannot happen unless a
  state change used no CPU in the workspace and wrote no file.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import TYPE_CHECKING

from ..errors import WorkspaceClosed
from ..runtime.template import Template

if TYPE_CHECKING:
    from ..runtime.workspace import Workspace

__all__ = ["adopt", "clean_template", "cpu_ns", "is_clean", "mark_clean"]

# ws -> (workspace dir id, settled cgroup CPU ns) when it was last a fresh fork of its template
_fresh: weakref.WeakKeyDictionary[Workspace, tuple[str, int]] = weakref.WeakKeyDictionary()


def adopt(ws: Workspace, kid: Workspace) -> None:
    """``ws`` becomes ``kid`` (a fork of a template ``ws`` may or may not descend from); ``kid``
    is spent, ``ws``'s previous processes are torn down. No tool call may run on either."""
    ws.adopt(kid)
    _fresh.pop(ws, None)


def cpu_ns(ws: Workspace) -> int | None:
    """CPU time the workspace's cgroup used (ns), or None without the cpu controller."""
    return ws.cgroup.stats().cpu_usage_ns


def _settled_cpu(ws: Workspace, quiet: float = 0.02, limit: float = 0.3) -> int | None:
    """The cgroup's CPU time once it stopped moving for ``quiet`` s (a fresh fork's processes
    finish resuming within a few ms)."""
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


def mark_clean(ws: Workspace) -> None:
    """Record that ``ws`` is, right now, a fresh fork of its template."""
    usage = _settled_cpu(ws)
    if usage is not None:
        _fresh[ws] = (ws.body.id, usage)


def is_clean(ws: Workspace) -> bool:
    """Whether ``ws`` is still exactly the fresh fork :func:`mark_clean` saw."""
    mark = _fresh.get(ws)
    core = ws.body.template
    if mark is None or ws.closed or core is None or core.closed:
        return False
    return mark == (ws.body.id, cpu_ns(ws)) and not os.listdir(ws.body.dir.upper)


def clean_template(ws: Workspace) -> Template | None:
    """A new handle on ``ws``'s template if ``ws`` is still a fresh fork of it, else None."""
    core = ws.body.template
    if core is None or not is_clean(ws):
        return None
    try:
        core.acquire()
    except WorkspaceClosed:
        return None
    return Template(core)
