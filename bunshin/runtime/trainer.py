"""What the trainer process gets once, with its first workspace: its soft descriptor limit
raised to the hard one (each workspace keeps a few descriptors in the trainer, and a trainer
keeps thousands of workspaces besides its own descriptors), and its owner watcher
(owner_watch.py)."""

from __future__ import annotations

import logging
import os
import resource
import threading

from . import owner_watch

log = logging.getLogger("bunshin.trainer")

_lock = threading.Lock()
_prepared = 0  # the pid prepared: a trainer forked since prepares again
_nofile: tuple[int, int] | None = None  # the trainer's limit before prepare() raised it


def prepare() -> None:
    global _prepared
    if _prepared == os.getpid():
        return
    with _lock:
        if _prepared != os.getpid():
            raise_nofile()
            owner_watch.start()
            _prepared = os.getpid()


def raise_nofile() -> None:
    global _nofile
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if _nofile is None:
        _nofile = (soft, hard)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            log.info("RLIMIT_NOFILE soft limit raised from %d to %d (the hard limit)", soft, hard)
        except (OSError, ValueError) as e:
            log.warning("RLIMIT_NOFILE soft limit stays %d: %s", soft, e)


def give_own_limits(pid: int) -> None:
    """Put back in a new workspace's init (``pid``, set up and asked nothing yet) the limit the
    trainer had before it was raised: the workspace's programs see the limits they would
    see on this machine, not the trainer's need."""
    if _nofile is not None and _nofile != resource.getrlimit(resource.RLIMIT_NOFILE):
        resource.prlimit(pid, resource.RLIMIT_NOFILE, _nofile)
