"""Which backend serves forks and accounting: the kernel module (/dev/bunshin) or user space.

Chosen once per process, here and nowhere else (as psutil does). ``BUNSHIN_KMOD`` overrides:

- ``auto`` (default): use /dev/bunshin when it is there and speaks this library's ABI;
  otherwise the user-space engine (ptrace, /proc/PID/pagemap), and :func:`backend` says why.
- ``0``: never use the module.
- ``1``: require it; :func:`backend` raises :class:`KmodUnavailable` naming what is wrong.

``BUNSHIN_KMOD_FORK=0`` keeps the module for everything but cloning and fixing clones up (FORK,
RUN), ``BUNSHIN_KMOD_RUN=0`` for everything but the fixups (benchmarks compare them).

Each verb is used only when the module serves it (its feature bit, and for REPARENT of a
traced clone module 0.2.0); the rest falls back on its own, so an older module still helps.
The device stays open for the life of the process (``rmmod`` waits for it to exit).
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass, field


from .. import config
from ..errors import UnsupportedKernel
from . import _kmod

__all__ = ["DEVICE", "ENV", "FORK_ENV", "RUN_ENV", "Backend", "Kmod", "KmodUnavailable", "backend", "reset"]

DEVICE = "/dev/bunshin"
ENV = "BUNSHIN_KMOD"
FORK_ENV = "BUNSHIN_KMOD_FORK"  # 0: keep the module's other verbs, clone by injection (A/B runs)
RUN_ENV = "BUNSHIN_KMOD_RUN"  # 0: clone with FORK, fix clones up by injection (A/B runs)
_MODES = ("auto", "0", "1")
_TRACED_SINCE = (0, 2, 0)  # module version that accepts BUNSHIN_REPARENT_TRACED
_IN_PARENT_SINCE = (0, 5, 0)  # module version that accepts BUNSHIN_FORK_IN_PARENT
FORK_MAX_CHILDREN = _kmod.FORK_MAX_CHILDREN


def why(e: OSError) -> str:
    """What a FORK or RUN errno means, for an error message (ETIMEDOUT is the module's own)."""
    if e.errno == errno.ETIMEDOUT:
        return ("the process did not get to the work within the module's fork_timeout_ms "
                "(/sys/module/bunshin/parameters/fork_timeout_ms): stuck in a signal stop or "
                "a freezer?")
    return e.strerror or str(e)


class KmodUnavailable(UnsupportedKernel):
    """BUNSHIN_KMOD=1 asked for the kernel module and it cannot be used (or the value is bad)."""


def _version(code: int) -> tuple[int, int, int]:
    return code >> 16, (code >> 8) & 0xFF, code & 0xFF


@dataclass(frozen=True)
class Kmod:
    """An open /dev/bunshin that speaks this library's ABI. Every call raises OSError with the
    kernel's errno; callers decide what an errno means for them."""

    fd: int
    abi_version: int
    module_version: tuple[int, int, int]
    features: int

    def serves(self, verb: str) -> bool:
        """Whether the module has ``verb`` (``"SHARE_STATS"``, ``"REPARENT"``, ``"GROUP_STATS"``,
        ``"FORK"``, ``"RUN"``)."""
        return bool(self.features >> _kmod.NR[verb] & 1)

    @property
    def reparents_traced(self) -> bool:
        """REPARENT accepts a clone the caller still traces (the fork engine's case)."""
        return self.serves("REPARENT") and self.module_version >= _TRACED_SINCE

    def group_stats(self, pids, groups, ngroups: int):
        """GROUP_STATS: (shared, total, nmms, per-group [mapped, distinct, shared] pages)."""
        return _kmod.group_stats(self.fd, pids, groups, ngroups)

    def share_stats(self, pids):
        """SHARE_STATS: (shared, total, nmms, per-pid [mapped, shared, unique] pages)."""
        return _kmod.share_stats(self.fd, pids)

    @property
    def forks_in_parent(self) -> bool:
        """FORK can make each child in its parent's namespaces, root and cgroups."""
        return self.serves("FORK") and self.module_version >= _IN_PARENT_SINCE

    def fork(self, pid: int, children: list[tuple[int, int, int]], child_tid: int = 0,
             in_parent: bool = False) -> list[int]:
        """FORK: clone ``pid`` (seized by the calling thread, stopped) once per
        ``(pidns_pid, tid, parent)``; ``in_parent``: each child in its parent's namespaces,
        root and cgroups (:attr:`forks_in_parent`). The OSError of a failure has ``made``
        and ``resumed``."""
        return _kmod.fork(self.fd, pid, children, child_tid,
                          _kmod.FORK_IN_PARENT if in_parent else 0)

    def run(self, pid: int, calls: list[tuple[int, tuple[int, ...], int, int]],
            data: bytes = b"") -> list[int]:
        """RUN: ``calls`` (``(nr, args, flags, ok_errno)``) made by ``pid`` itself (seized by the
        calling thread, stopped) with ``data`` mapped; the results of those that ran. The
        OSError of a failure has ``resumed``."""
        return _kmod.run(self.fd, pid, calls, data)

    def join_session(self, pid: int, session_of: int, pgrp_of: int) -> tuple[int, int]:
        """JOIN_SESSION: host pid ``pid`` into the session of ``session_of`` and the group of
        ``pgrp_of`` (``pid``: its own); its old ``(sid, pgid)``."""
        return _kmod.join_session(self.fd, pid, session_of, pgrp_of)

    def reparent(self, pid: int, new_parent: int, traced: bool = False) -> int:
        """Move host pid ``pid`` under ``new_parent``; ``traced``: the calling thread traces it."""
        return _kmod.reparent(self.fd, pid, new_parent, _kmod.REPARENT_TRACED if traced else 0)


@dataclass(frozen=True)
class Backend:
    """The choice made for this process, and why (shown by ``bunshin doctor``)."""

    mode: str
    """The ``BUNSHIN_KMOD`` value it was made under (``auto``, ``0`` or ``1``)."""
    kmod: Kmod | None
    """The module, or None for the user-space engine."""
    reason: str
    uses: dict[str, str] = field(default_factory=dict)
    """What each job goes through: ``{"fork parents": ..., "memory accounting": ...}``."""
    fork_wanted: bool = True
    """False under ``BUNSHIN_KMOD_FORK=0``: clone by injection even with a module that has FORK."""
    run_wanted: bool = True
    """False under ``BUNSHIN_KMOD_RUN=0`` (or FORK=0): fix clones up by injection even with RUN."""

    @property
    def name(self) -> str:
        return "kmod" if self.kmod is not None else "user"

    @property
    def reparent(self) -> Kmod | None:
        """The module when forks can make exact parent links with it."""
        return self.kmod if self.kmod is not None and self.kmod.reparents_traced else None

    @property
    def fork(self) -> Kmod | None:
        """The module when forks can clone processes in the kernel (FORK); it comes with
        REPARENT, which the engine also needs."""
        k = self.reparent
        return k if k is not None and k.serves("FORK") and self.fork_wanted else None

    @property
    def fork_in_parent(self) -> Kmod | None:
        """The module when FORK makes each clone in the child's namespaces, root and cgroups
        (those of its parent there, the child's init): no setns, no cgroup move after."""
        k = self.fork
        return k if k is not None and k.forks_in_parent else None

    @property
    def run(self) -> Kmod | None:
        """The module when a clone's fixups can run inside it without ptrace stops (RUN);
        used with FORK, and so off under ``BUNSHIN_KMOD_FORK=0`` too."""
        k = self.fork
        return k if k is not None and k.serves("RUN") and self.run_wanted else None

    @property
    def join_session(self) -> Kmod | None:
        """The module when a clone can be moved into its session leader's clone's session
        (JOIN_SESSION), with REPARENT: the tree, sessions and groups made exact together."""
        k = self.reparent
        return k if k is not None and k.serves("JOIN_SESSION") else None

    @property
    def group_stats(self) -> Kmod | None:
        """The module when memory accounting can count in the kernel."""
        return self.kmod if self.kmod is not None and self.kmod.serves("GROUP_STATS") else None


_lock = threading.Lock()
_chosen: Backend | None = None


def _open() -> tuple[Kmod | None, str]:
    if not os.path.exists(DEVICE):
        return None, f"{DEVICE} is absent (bunshin.ko not loaded; see kmod/README.md)"
    try:
        fd = os.open(DEVICE, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        return None, f"cannot open {DEVICE}: {e.strerror} (root only)"
    try:
        abi, code, features = _kmod.get_version(fd)
    except OSError as e:
        os.close(fd)
        return None, f"{DEVICE} did not answer GET_VERSION: {e.strerror}"
    if abi != _kmod.ABI_VERSION:
        os.close(fd)
        return None, (f"{DEVICE} speaks ABI v{abi}, this library v{_kmod.ABI_VERSION}: "
                      "rebuild and reload kmod/")
    return Kmod(fd, abi, _version(code), features), ""


def _uses(k: Kmod | None, fork_wanted: bool = True, run_wanted: bool = True) -> dict[str, str]:
    if k is None:
        return {"fork clones": "user space: injected clone3 through an intermediate process",
                "fork fixups": "user space: injected system calls",
                "fork sessions": "user space: each clone joins its session as its parent's clone makes it",
                "fork parents": "user space: each clone made by its parent's clone (BUNSHIN_TREE)",
                "memory accounting": "user space: /proc/PID/pagemap"}
    v = ".".join(map(str, k.module_version))
    if not k.serves("FORK"):
        clones = f"user space: injected clone3 (module {v} has no FORK)"
    elif not fork_wanted:
        clones = f"user space: injected clone3 ({FORK_ENV}=0)"
    elif not k.forks_in_parent:
        clones = (f"kmod FORK: each process cloned in the kernel into the child's pid namespace "
                  f"(module {v}: then setns and a cgroup move; "
                  f"{'.'.join(map(str, _IN_PARENT_SINCE))} clones into all its namespaces)")
    else:
        clones = "kmod FORK: each process cloned in the kernel into the child's namespaces and cgroups"
    if not k.serves("RUN"):
        fixups = f"user space: injected system calls (module {v} has no RUN)"
    elif not fork_wanted:
        fixups = f"user space: injected system calls ({FORK_ENV}=0)"
    elif not run_wanted:
        fixups = f"user space: injected system calls ({RUN_ENV}=0)"
    elif not k.serves("FORK") or not k.reparents_traced:
        fixups = f"user space: injected system calls (module {v}: RUN is used with FORK only)"
    else:
        fixups = "kmod RUN: each clone's fixup calls made by it in the kernel, in one resume"
    return {
        "fork clones": clones,
        "fork fixups": fixups,
        "fork sessions": ("kmod JOIN_SESSION: a shell's jobs in its clone's session"
                          if k.serves("JOIN_SESSION") and k.reparents_traced else
                          f"user space: module {v} has no JOIN_SESSION; clones keep the "
                          "template's sessions (outside the child)"),
        "fork parents": ("kmod REPARENT: each clone under the clone of its parent"
                         if k.reparents_traced else
                         f"user space: module {v} cannot reparent a traced clone (needs "
                         f"{'.'.join(map(str, _TRACED_SINCE))}); clones are parented to init"),
        "memory accounting": ("kmod GROUP_STATS" if k.serves("GROUP_STATS") else
                              f"user space: /proc/PID/pagemap (module {v} has no GROUP_STATS)"),
    }


def _choose() -> Backend:
    mode = config.kmod_mode()
    if mode not in _MODES:
        raise KmodUnavailable(f"{ENV}={mode!r}: use auto, 0 (user space) or 1 "
                              "(require /dev/bunshin)")
    if mode == "0":
        why = f"{ENV}=0"
        return Backend(mode, None, why, _uses(None))
    k, why = _open()
    if k is None:
        if mode == "1":
            raise KmodUnavailable(f"{ENV}=1 requires the kernel module, but {why}")
        return Backend(mode, None, why, _uses(None))
    v = ".".join(map(str, k.module_version))
    reason = f"{DEVICE}: ABI v{k.abi_version}, module {v}" + (f" ({ENV}=1)" if mode == "1" else "")
    fork_wanted = config.kmod_fork()
    run_wanted = config.kmod_run()
    return Backend(mode, k, reason, _uses(k, fork_wanted, run_wanted), fork_wanted, run_wanted)


def backend() -> Backend:
    """The backend of this process, chosen on first use (raises KmodUnavailable only for
    ``BUNSHIN_KMOD=1`` without a usable module, or a bad value)."""
    global _chosen
    b = _chosen
    if b is not None:
        return b
    with _lock:
        if _chosen is None:
            _chosen = _choose()
        return _chosen


def reset() -> None:
    """Forget the choice (tests, or after loading the module): the next call chooses again."""
    global _chosen
    with _lock:
        if _chosen is not None and _chosen.kmod is not None:
            os.close(_chosen.kmod.fd)
        _chosen = None


def gone(e: OSError) -> bool:
    """ESRCH from a stats verb: some pid exited (or is a zombie) meanwhile."""
    return e.errno == errno.ESRCH

