"""``bunshin gc``: remove what crashed trainers left behind (state dirs, cgroups, inits,
idmapped views)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time

from .. import config
from . import cgroup, statedir, userns

log = logging.getLogger("bunshin.gc")


# A directory is made a moment before its meta file names its owner (body.allocate): one
# without a meta file is a leftover only once it is older than this.
_UNCLAIMED_AGE = 30.0


def collect(*, dry_run: bool = False, owner: tuple[int, int] | None = None) -> list[str]:
    """Remove every workspace whose owning process is gone, or, with ``owner`` (pid, start
    time), only that dead owner's: its watcher's call, which leaves other trainers' leftovers
    and cgroups to their own. Returns the ids removed."""
    removed = []
    live_cgroups = set()
    dead_cgroups = set()  # of this state directory's dead workspaces: frozen templates included
    for d in statedir.all_dirs():
        meta = d.read_meta()
        if meta is not None and statedir.owner_alive(meta):
            live_cgroups.add(meta.cgroup)
            continue
        if owner is not None and (meta is None or (meta.owner_pid, meta.owner_start) != owner):
            continue
        if meta is None and _younger_than(d.path, _UNCLAIMED_AGE):
            continue
        if meta is not None:
            dead_cgroups.add(meta.cgroup)
        removed.append(d.id)
        if dry_run:
            continue
        if meta is not None and meta.init_pid and statedir.proc_start_time(meta.init_pid) is not None:
            _kill_if_ours(meta.init_pid)
        d.remove()
    backend = cgroup.backend()
    for name in backend.list():
        if name in live_cgroups or (owner is not None and name not in dead_cgroups):
            continue
        try:
            cg = backend.open(name)
        except Exception:  # noqa: BLE001 - removed meanwhile
            continue
        if name not in dead_cgroups and not _ours(cg.pids()):
            # Running and not from this state directory: another trainer's, with another
            # BUNSHIN_STATE_DIR but the same cgroup prefix. Its own gc will judge it.
            log.warning("cgroup %s has processes but no workspace in %s: left alone", name,
                        config.state_dir())
            continue
        if not dry_run:
            cg.destroy()
        removed.append(f"cgroup:{name}")
    # a dead trainer's attached idmapped views (runtime/userns.py): mounts in its mount
    # namespace, which is ours when it ran in it (else they went with it)
    for top in userns.dead_views():
        if owner is not None and not top.name.startswith(f"{owner[0]}-{owner[1]}-"):
            continue
        removed.append(f"idmap:{top.name}")
        if not dry_run:
            try:
                userns.remove_views(top)
            except OSError as e:
                log.warning("idmapped views %s stay: %s", top, e)
    # the frozen empty group is every Bunshin's on the machine: only a gc by hand removes it
    if not dry_run and owner is None and not backend.list() and backend.remove_freezer_on():
        removed.append("cgroup:freezer-on")
    # the state file system is every trainer's of this state directory: one may be making a
    # workspace in it right now, between its mount check and its mkdir, so only a gc by hand
    # unmounts it
    if not dry_run and owner is None and not live_cgroups:
        from . import statefs

        try:
            if statefs.release():
                removed.append("state file system")
        except Exception as e:  # noqa: BLE001 - busy mounts are reported, not fatal
            log.warning("state file system stays mounted: %s", e)
    return removed


def _younger_than(path: os.PathLike, seconds: float) -> bool:
    try:
        return time.time() - os.stat(path).st_mtime < seconds
    except OSError:
        return False


def _ours(pids: list[int]) -> bool:
    """True when no process runs in the group, or one of them is an init (or a fork of one:
    it shares the argv) whose root lies in this state directory."""
    if not pids:
        return True
    mine = str(config.state_dir()).rstrip("/") + "/"
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"--root" in argv[:-1] and os.fsdecode(argv[argv.index(b"--root") + 1]).startswith(mine):
            return True
    return False


def _kill_if_ours(pid: int) -> None:
    # Only an init started from our binary; a recycled pid must not be shot.
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return
    if os.path.basename(exe).startswith("bunshin-init"):
        os.kill(pid, signal.SIGKILL)


def main(args: argparse.Namespace | None = None) -> int:
    dry = bool(getattr(args, "dry_run", False))
    removed = collect(dry_run=dry)
    verb = "would remove" if dry else "removed"
    print(f"{verb} {len(removed)} leftover(s)" + (": " + ", ".join(removed) if removed else ""))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="list what would be removed")
