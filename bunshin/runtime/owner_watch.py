"""One watcher process per trainer: when the trainer ends without closing its workspaces (killed
by SIGKILL or the OOM killer, or an exit that skipped ``atexit``), the watcher removes them —
frozen templates, children, cgroups, mounts and state directories — within a second.

A frozen template cannot notice anything itself, and a trainer cannot clean up after its own
SIGKILL, so the watcher is a separate process: started with the trainer's first workspace, in a
session of its own (a Ctrl-C or a hang-up that ends the trainer's group spares it), it sleeps on
a pidfd of the trainer, then runs ``bunshin gc`` for that one dead owner and exits. It costs one
idle Python process per trainer. ``BUNSHIN_OWNER_WATCH=0`` turns it off.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

from .. import config
from ..fdwait import readable
from . import gc, statedir

log = logging.getLogger("bunshin.owner_watch")

# kept so that it is never collected (and waited for) while the trainer lives
_watcher: subprocess.Popen | None = None


def start() -> None:
    """Start this trainer process's watcher (trainer.prepare calls it once per process: a
    forked trainer gets its own)."""
    global _watcher
    if not config.owner_watch():
        return
    pid = os.getpid()
    env = dict(os.environ, BUNSHIN_STATE_DIR=str(config.state_dir()))
    try:
        _watcher = subprocess.Popen(
            [sys.executable, "-m", "bunshin.runtime.owner_watch", str(pid), str(statedir.own_start_time())],
            env=env, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:  # out of processes or memory: the workspace can do without
        log.warning("no owner watcher (%s): if this trainer is killed, `bunshin gc` removes "
                    "its workspaces", e)


def _wait_for_end(pid: int, start: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if statedir.proc_start_time(pid) != start:  # gone already, its pid reused
            return
        while not readable(fd, 3600):
            pass
    finally:
        os.close(fd)


def watch(pid: int, start: int) -> list[str]:
    """Wait for the trainer ``pid`` (started at ``start``) to end, then remove what it left;
    what is removed."""
    _wait_for_end(pid, start)
    removed: list[str] = []
    for attempt in range(5):  # a frozen process dies only once its cgroup thaws: look again
        removed += gc.collect(owner=(pid, start))
        left = [d.id for d in statedir.all_dirs()
                if (m := d.read_meta()) is not None and (m.owner_pid, m.owner_start) == (pid, start)]
        if not left:
            break
        time.sleep(0.1 * (attempt + 1))
    else:
        log.warning("left behind by trainer %d: %s", pid, ", ".join(left))
    return removed


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]))
