"""Room for one more workspace (descriptors, memory, the state file system's space), checked
before any part of it is made: a clear :class:`~bunshin.errors.OutOfResources` up front,
instead of a failure half-way through a create or a fork (whose clean-up would itself need the
descriptors that ran out), and a reserve left so that the workspaces already there can still
run calls and be closed."""

from __future__ import annotations

import os
import resource
from pathlib import Path

from ..errors import OutOfResources
from . import cgroup

# Descriptors a workspace keeps in the trainer (~3: its control socket, pidfd, a pty master)
# plus what making one opens for a moment (pipes, cgroup files, namespace files).
FDS_PER_WORKSPACE = 12
# Kept free for the workspaces already there: a call opens a few pipes, a close a pidfd.
FDS_RESERVE = 64
# Free space a workspace needs to start (its directory, meta and log; a fork's snapshot).
MIN_FREE_BYTES = 64 << 20
# Memory a workspace needs to start: an init, a few page tables, a shell; a fork's first writes.
MIN_FREE_MEMORY = 64 << 20


def check(state_dir: Path, image: Path | None = None) -> None:
    """Raise OutOfResources when the trainer's descriptors, the memory (the machine's, or the
    workspaces' cgroup's limit) or the state file system (and the file system holding its
    image) leave no room for one more workspace."""
    _descriptors()
    _memory()
    _space(state_dir, "the state file system")
    if image is not None:
        _space(image.parent, f"the file system holding {image.name}")


def _descriptors() -> None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = FDS_RESERVE + FDS_PER_WORKSPACE
    try:
        lowest = os.open("/", os.O_PATH | os.O_CLOEXEC)
        os.close(lowest)
    except OSError:
        lowest = soft
    # a new descriptor takes the lowest free number: the one just had lies below the mark
    # when the table is not that full (counting /proc/self/fd costs a read per entry)
    if lowest < soft - need:
        return
    used = len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
    if soft - used >= need:  # free numbers below: closed ones
        return
    raise OutOfResources(
        f"the trainer holds {used} descriptors of its limit of {soft} (RLIMIT_NOFILE), and a new "
        f"workspace needs {FDS_PER_WORKSPACE} with {FDS_RESERVE} kept for the workspaces already "
        "there: close workspaces or descriptors, or raise the hard limit (ulimit -Hn)")


def _memory() -> None:
    room = cgroup.backend().memory_room()
    if room is not None and room[1] - room[2] < MIN_FREE_MEMORY:
        group, limit, usage = room
        raise OutOfResources(
            f"the workspaces' cgroup {group} uses {usage >> 20} MiB of its memory limit of "
            f"{limit >> 20} MiB, and a workspace needs {MIN_FREE_MEMORY >> 20} MiB to start: close "
            "workspaces, or raise that limit")
    with open("/proc/meminfo") as f:
        avail = next((int(ln.split()[1]) << 10 for ln in f if ln.startswith("MemAvailable:")), None)
    if avail is not None and avail < MIN_FREE_MEMORY:
        raise OutOfResources(
            f"the machine has {avail >> 20} MiB of memory available (MemAvailable), and a "
            f"workspace needs {MIN_FREE_MEMORY >> 20} MiB to start: close workspaces or free memory")


def no_process(what: str) -> OutOfResources:
    """The error for a clone() that failed with EAGAIN: the pids limit of the trainer's cgroup,
    or of the machine, is reached (``what``: what could not be started)."""
    limits = []
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((ln.split(":", 2)[2].strip() for ln in f
                        if ln.split(":", 2)[1] in ("pids", "")), None)
        for mount in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup"):
            if rel is not None and os.path.exists(f"{mount}{rel}/pids.max"):
                cap = Path(f"{mount}{rel}/pids.max").read_text().strip()
                now = Path(f"{mount}{rel}/pids.current").read_text().strip()
                limits.append(f"the trainer's cgroup {rel} holds {now} tasks of its pids.max {cap}")
                break
    except (OSError, StopIteration, IndexError):
        pass
    tasks = sum(1 for n in os.listdir("/proc") if n.isdigit())
    pid_max = Path("/proc/sys/kernel/pid_max").read_text().strip()
    limits.append(f"the machine runs {tasks} processes (pid_max {pid_max})")
    return OutOfResources(f"cannot start {what}: no process can be made ({'; '.join(limits)}): "
                          "close workspaces, or raise the pids limit")


def _space(path: Path, what: str) -> None:
    try:
        st = os.statvfs(path)
    except OSError:
        return  # not made yet: statefs.ensure() makes it
    if st.f_bavail * st.f_frsize < MIN_FREE_BYTES:
        raise no_space(path, what)


def no_space(path: Path, what: str = "the state file system") -> OutOfResources:
    """The error for a file system with no room for a workspace (found by the check, or by an
    ENOSPC: btrfs can run out of room for metadata with data blocks still free)."""
    st = os.statvfs(path)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    return OutOfResources(
        f"{what} ({path}) is full ({free >> 20} MiB free of {total >> 20} MiB; a workspace needs "
        f"{MIN_FREE_BYTES >> 20} MiB to start): close workspaces or free space there")
