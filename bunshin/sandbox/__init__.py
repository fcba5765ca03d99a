"""Container-runtime defaults for ``isolation="sandbox"`` workspaces: a seccomp filter
(:mod:`.seccomp`), a capability bounding set, masked and read-only paths of ``/proc`` and
``/sys``, as Docker gives a container by default.

The workspace init applies them (``_core/init/sandbox.c``) after mounting its ``/proc``,
``/sys`` and ``/dev`` and before it starts anything: every process of the workspace descends
from it, and a fork's init is a clone of it (it keeps the filter and capabilities, and masks
its fresh ``/proc`` and ``/sys`` the same way). The init is told them in its environment
(:func:`init_env`), which it then clears.

Alone, they stop what needs a capability that is dropped or a call that is filtered. A mask or
read-only mount holds against root only in a user namespace of its own (the mounts are then
locked); without one, root may unmount them."""

from __future__ import annotations

import functools

from ..errors import IsolationError

ISOLATIONS = ("sandbox", "trusted")

# capability -> why a workspace has no use for it (what it would reach is the host's). Kept:
# what the fork needs in each process (SYS_ADMIN for setns and mounts, SYS_CHROOT,
# SYS_RESOURCE for PR_SET_MM, SYS_PTRACE, SETUID/SETGID, CHECKPOINT_RESTORE, NET_ADMIN for
# TCP_REPAIR and loopback) and what has a use in the workspace's namespaces (LEASE: leases on
# its own files; MKNOD; SYS_NICE; SYS_TTY_CONFIG: vhangup of its own ptys).
DROPPED_CAPS: dict[str, tuple[int, str]] = {
    "CAP_SYS_MODULE": (16, "kernel modules are the host's"),
    "CAP_SYS_RAWIO": (17, "raw I/O ports and device memory are the host's"),
    "CAP_SYS_PACCT": (20, "process accounting is the host's"),
    "CAP_SYS_BOOT": (22, "reboot and kexec act on the host"),
    "CAP_SYS_TIME": (25, "the clock is the host's"),
    "CAP_AUDIT_CONTROL": (30, "the audit system is not namespaced"),
    "CAP_MAC_OVERRIDE": (32, "the host's LSM policy"),
    "CAP_MAC_ADMIN": (33, "the host's LSM policy"),
    "CAP_SYSLOG": (34, "the host's kernel log"),
    "CAP_WAKE_ALARM": (35, "wakes the host from suspend"),
    "CAP_BLOCK_SUSPEND": (36, "keeps the host from suspending"),
    "CAP_AUDIT_READ": (37, "the audit system is not namespaced"),
    "CAP_PERFMON": (38, "observes the host's kernel and other processes"),
    "CAP_BPF": (39, "loads programs into the host's kernel"),
}

# Docker's masked paths: files are covered with /dev/null, directories with an empty
# read-only tmpfs. A path the kernel does not have is skipped.
MASKED = ("/proc/acpi", "/proc/asound", "/proc/interrupts", "/proc/kcore", "/proc/keys",
          "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug",
          "/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap")
# Docker's read-only paths; the writable paths are bound on themselves first so they stay
# writable under a read-only parent. They are the sysctls of the workspace's own namespaces
# (those Docker's --sysctl accepts): the network namespace's /proc/sys/net, the IPC
# namespace's SysV and mqueue limits and next ids, the UTS namespace's names. /sys is
# read-only as mounted.
READ_ONLY = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")
WRITABLE = ("/proc/sys/net", "/proc/sys/fs/mqueue",
            *(f"/proc/sys/kernel/{n}" for n in (
                "msgmax", "msgmnb", "msgmni", "msg_next_id", "sem", "sem_next_id", "shmall",
                "shmmax", "shmmni", "shm_next_id", "shm_rmid_forced", "hostname", "domainname")))


def check_isolation(isolation: object) -> str:
    """``isolation`` if it is one of ISOLATIONS; a sandbox's filter is compiled here, so that a
    missing libseccomp is told before anything of the workspace is made."""
    if not isinstance(isolation, str) or isolation not in ISOLATIONS:
        raise IsolationError(f"isolation must be one of {', '.join(map(repr, ISOLATIONS))}, "
                             f"got {isolation!r}")
    if isolation == "sandbox":
        init_env()
    return isolation


@functools.lru_cache(maxsize=1)
def init_env() -> tuple[str, ...]:
    """The init's environment entries that make it apply the sandbox (read by sandbox.c)."""
    from . import seccomp

    drop = 0
    for bit, _why in DROPPED_CAPS.values():
        drop |= 1 << bit
    return (f"BUNSHIN_SB_CAPS={drop:x}", f"BUNSHIN_SB_BPF={seccomp.program().hex()}",
            f"BUNSHIN_SB_MASK={':'.join(MASKED)}", f"BUNSHIN_SB_RO={':'.join(READ_ONLY)}",
            f"BUNSHIN_SB_RW={':'.join(WRITABLE)}")
