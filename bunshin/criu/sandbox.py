"""CRIU and a sandbox workspace (``isolation="sandbox"``, runtime/userns.py).

CRIU dumps the workspace's user namespace U with its task tree (its uid and gid maps) and
restores a new one with the same maps, owning the restored mount, pid, net, ipc, uts and
cgroup namespaces; seccomp filters, capability sets (the bounding set too) and the mounts
the init made inside U (masked and read-only ``/proc`` and ``/sys`` paths) are dumped and
made again as they were. Three parts CRIU cannot make by itself:

- **The device nodes** (``/dev/null``, ``zero``, ..., and the ``/dev/null`` that covers a
  masked ``/proc`` file) are binds of the host's devtmpfs (U may not ``mknod``), whose root
  CRIU cannot find in the workspace. Each is dumped as an external mount named by the host path
  it binds (:func:`device_binds`) and bound again from that path on restore.
- **The root**: overlayfs on the rootfs's layers idmapped with U, mounted by the trainer. The
  root is never dumped (``root``, as for any workspace); the restore mounts it again on views
  of the rootfs's layers idmapped with a user namespace of the same maps (an idmapped mount
  takes the maps, not the namespace), before CRIU makes the new U.
- **The cgroup namespace** the init made in U, rooted at the workspace's group: see
  :data:`CGROUPS`.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from .._core import _syscalls
from ..errors import CheckpointError, ImageError
from ..runtime import userns as _userns
from ..runtime.cgroup._fs import cgroup_mounts, mounts

#: The init's cgroup namespace (rooted at the workspace's group, owned by U) comes back only
#: where CRIU moves the restored tasks into their groups itself: it enters the group the image
#: names as the namespace's root, then unshares one in U. ``none``: into groups that exist
#: (the restored workspace's, given as the root of each hierarchy with ``cg_root``),
#: their limits left as Bunshin set them. Threads need it too: CRIU 4.2.1 records a thread of
#: a process other than the init in a set of its own (the namespace's prefix is copied into a
#: set only after it is compared), and moves it there, which with ``ignore`` fails (no
#: cgroup yard: EBADF). The name of pycriu's ``criu_cg_mode`` value.
CGROUPS = "CG_NONE"
_CGROUP_TOP = "/sys/fs/cgroup"


def cgroup_yard() -> str:
    """``/sys/fs/cgroup`` where every hierarchy is mounted there, at its root, by the name CRIU
    gives it (its controllers, ``name=`` left out; ``unified`` for v2): CRIU then mounts none
    in a yard of its own (mounting the v2 hierarchy again costs ~9 ms here). "" otherwise, as
    CRIU would make a missing one's directory in the host's /sys/fs/cgroup."""
    roots = {m.point for m in cgroup_mounts() if m.root == "/"}
    with open("/proc/self/cgroup") as f:
        for line in f:
            ctrls = line.rstrip("\n").split(":", 2)[1]
            name = ",".join("unified" if not c else c.removeprefix("name=") for c in ctrls.split(","))
            if f"{_CGROUP_TOP}/{name}" not in roots:
                return ""
    return _CGROUP_TOP


def device_binds(init_pid: int) -> list[tuple[str, str]]:
    """(mount point in the workspace, host path it binds) of each mount of the host's ``/dev``
    in ``init_pid``'s mount namespace. Named explicitly: CRIU's own search (``mnt[]``) takes
    the last mount of the host's that shows the file, which may be a passing one."""
    devs = {m.device for m in mounts() if m.point == "/dev" and m.root == "/"}
    return [(m.point, "/dev" + m.root) for m in mounts(f"/proc/{init_pid}/mountinfo")
            if m.device in devs and m.root != "/"]


def dump_binds(binds: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """CRIU's external mounts (``ext_mnt``: key, value) dumping ``binds``
    (:func:`device_binds`): each keyed by its mount point, named by the host path."""
    return [(point, host) for point, host in binds]


def restore_options(meta: dict, opts, rpc) -> None:
    """Set in ``opts`` (pycriu's ``criu_opts``; ``rpc`` its message module) what restoring a
    sandbox's image takes: its device binds (the host paths the dump named them by) bound
    again, and its groups and cgroup namespace made (:data:`CGROUPS`, :func:`cgroup_yard`; the
    restore adds each hierarchy's ``cg_root`` as its worker finds itself placed)."""
    hosts = meta.get("device_binds", [])
    for h in hosts:
        if not os.path.exists(h):
            raise ImageError(f"the image binds the host's {h} into the workspace, and this host "
                             "has none")
    for h in hosts:
        opts.ext_mnt.add(key=h, val=h)
    opts.manage_cgroups_mode = getattr(rpc, CGROUPS)
    yard = cgroup_yard()
    if yard:
        opts.cgroup_yard = yard


def idmap_views(rootfs_lowers: list[str]) -> _userns.UserNs:
    """Views of ``rootfs_lowers`` idmapped as a sandbox's (``UserNs.layer``), through a user
    namespace made for that alone with the sandbox's maps; the caller closes it once the
    overlay built on them is mounted (overlayfs keeps its own copies of its layers' mounts)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = pidfd = -1
    try:
        # A clone into a new user namespace waits for one byte before it execs (clone_exec.c):
        # given its maps and opened, it gets EOF instead and exits without running anything.
        pid, pidfd = _syscalls.clone_exec(_userns.CLONE_NEWUSER, "/bin/true", ["true"], [],
                                          (theirs.fileno(),) * 3, theirs.fileno())
        theirs.close()
        return _userns.UserNs.of_new_init(pid, tuple(Path(p) for p in rootfs_lowers))
    except OSError as e:
        raise CheckpointError(f"cannot make a user namespace to idmap the rootfs layers of a "
                              f"sandbox workspace: {e.strerror}") from None
    finally:
        ours.close()
        theirs.close()
        if pid > 0:
            os.waitpid(pid, 0)
        if pidfd >= 0:
            os.close(pidfd)


def restored_userns(init_pid: int, rootfs_lowers: list[str]) -> _userns.UserNs:
    """U of a restored sandbox's init, checked to have the sandbox's maps (CRIU restores the
    maps the image holds; an image of another mapping would give the trainer's ids wrong)."""
    want = [(0, _userns.BASE, _userns.SIZE)]
    for kind in ("uid", "gid"):
        got = _userns.extents(init_pid, kind)
        if got != want:
            raise CheckpointError(f"the restored workspace's user namespace maps {kind}s {got}, "
                                  f"not the sandbox's {want}: the image was made with another "
                                  "mapping")
    return _userns.UserNs.of(init_pid, tuple(Path(p) for p in rootfs_lowers))
