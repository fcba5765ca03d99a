"""The state directory is a file system of its own.

overlayfs refuses layers nested inside one another: a forked workspace's lower layers are its
template's upper directory *and* the host's root (the default rootfs), so upper directories
must not live on the root file system. Unless the state directory already is a separate mount,
Bunshin loop-mounts a sparse image (``<state_dir>.img``, ``BUNSHIN_STATE_SIZE``, default
256G — only what is written takes disk space) there, once: btrfs, whose subvolume snapshots
freeze a workspace's upper layer for its children in O(1) (runtime/layers.py), or ext4 where
mkfs.btrfs is missing (each fork then copies the upper layer). Bunshin's btrfs image gets
simple quotas, which bound what each workspace writes, and a size that leaves the host's disk
a reserve (runtime/quota.py).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

from .. import config
from ..errors import BunshinError
from . import quota

log = logging.getLogger("bunshin.statefs")
_lock = threading.Lock()
_ready: set[str] = set()


# nobarrier: the image holds live workspaces only, which a crash of the host ends anyway, and
# a cache flush of a loop device is an fsync of its backing file on the host's file system:
# without it the btrfs snapshot each ws.fork() takes costs ~0.3 ms instead of ~0.8-1.3 ms
# (a snapshot commits a transaction; measured on a loop-mounted image here)
MOUNT_OPTIONS = "loop,noatime,nobarrier"


def _separate(path: Path) -> bool:
    return os.path.ismount(path) and os.stat(path).st_dev != os.stat("/").st_dev


def image_path(state: Path) -> Path:
    return state.with_name(state.name + ".img")


def ensure() -> Path:
    """The state directory, mounted on its own file system; idempotent and process-safe."""
    state = config.state_dir()
    key = str(state)
    if key in _ready and os.path.ismount(state):  # another process's `gc` may have released it
        return state
    with _lock:
        state.mkdir(parents=True, exist_ok=True)
        with open(state.with_name(state.name + ".lock"), "w") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX)
            if not _separate(state):
                _mount_image(state)
            _tune(state)
        _ready.add(key)
    return state


def _mount_image(state: Path) -> None:
    img = image_path(state)
    size = config.state_size()
    try:
        if not img.exists():
            tmp = img.with_suffix(".img.tmp")
            subprocess.run(["truncate", "-s", size, str(tmp)], check=True, capture_output=True)
            subprocess.run(_mkfs(str(tmp)), check=True, capture_output=True)
            os.replace(tmp, img)
        subprocess.run(["mount", "-o", MOUNT_OPTIONS, str(img), str(state)], check=True, capture_output=True)
    except FileNotFoundError as e:
        raise BunshinError(f"cannot set up the state file system: {e.filename} is missing "
                           "(apt-get install btrfs-progs util-linux), or mount a file system of your "
                           f"own at {state}") from None
    except subprocess.CalledProcessError as e:
        raise BunshinError(f"cannot set up the state file system at {state}: "
                           f"{e.stderr.decode(errors='replace').strip()}; mount a file system of your "
                           f"own there (tmpfs, xfs, ext4) or set BUNSHIN_STATE_DIR") from None
    log.info("state directory %s is a loop-mounted image %s (%s sparse)", state, img, size)


def ours(state: Path) -> list[str] | None:
    """Type, source and options of the mount at ``state`` when it is our image (a file
    system of the user's own is left as it is), else None."""
    mounted = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(state):  # the last one is on top
            mounted = fields[fields.index("-") + 1:]  # type, source, options
    if mounted is None or len(mounted) < 3 or not mounted[1].startswith("/dev/loop"):
        return None
    try:
        backing = Path(f"/sys/block/{os.path.basename(mounted[1])}/loop/backing_file").read_text().strip()
    except OSError:
        return None
    return mounted if backing == str(image_path(state)) else None


def _tune(state: Path) -> None:
    """Our image, also one mounted by an older version, gets what this one mounts it with:
    no barriers, quotas, and a size that leaves the host's disk a reserve. Other trainers may
    share it live: only what differs is changed."""
    quotas = quota.note_mode(state)
    mounted = ours(state)
    if mounted is None:
        return
    if "nobarrier" not in mounted[2].split(","):
        r = subprocess.run(["mount", "-o", "remount,nobarrier", str(state)], capture_output=True)
        if r.returncode:
            log.info("cannot remount %s with nobarrier (each ws.fork() then costs ~0.5 ms more): %s",
                     state, r.stderr.decode(errors="replace").strip())
    if mounted[0] == "btrfs":
        resized = quota.fit_image(state, image_path(state))
        enabled = quotas == "disabled" and quota.enable(state)
        if enabled or (resized and quotas != "disabled"):
            quota.bound_all(state)


def _mkfs(img: str) -> list[str]:
    if shutil.which("mkfs.btrfs"):
        # one copy of data and metadata: a scratch image of live workspaces, not an archive
        return ["mkfs.btrfs", "-q", "-f", "-m", "single", "-d", "single", img]
    log.warning("mkfs.btrfs is missing (apt-get install btrfs-progs): the state file system is ext4, "
                "and every fork copies its workspace's upper layer")
    return ["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-E", "nodiscard,lazy_itable_init=1", img]


def release() -> bool:
    """Unmount the image and delete it when no workspace is left in it. True if it did."""
    state = config.state_dir()
    img = image_path(state)
    with _lock, open(state.with_name(state.name + ".lock"), "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)  # the same lock ensure() takes: no workspace appears meanwhile
        if not img.exists() or not os.path.ismount(state):
            return False
        ws = state / "ws"
        if ws.exists() and any(ws.iterdir()):
            return False
        subprocess.run(["umount", str(state)], check=True, capture_output=True)
        img.unlink()
        _ready.discard(str(state))
    return True
