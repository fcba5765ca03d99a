"""What every cgroup backend offers: the :class:`CgroupBackend` and :class:`Cgroup` contracts.

A workspace owns one cgroup, ``<prefix>/<name>`` in every hierarchy the backend uses, where
``<prefix>`` is :func:`bunshin.config.cgroup_prefix`. The workspace's init joins by writing
``"0"`` into each of :meth:`Cgroup.procs_files`; everything it starts inherits the group.
"""

from __future__ import annotations

import os
import signal
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import EllipsisType
from typing import TypeVar

from ... import config
from ...errors import CgroupError
from . import _fs
from .limits import Limits, parse_cpu, parse_memory, parse_pids

__all__ = ["CONTROLLERS", "Cgroup", "CgroupBackend", "CgroupStats"]

#: The controllers Bunshin uses, as reported by :meth:`CgroupBackend.controllers`.
CONTROLLERS = ("memory", "pids", "freezer", "cpu")

_T = TypeVar("_T")


@dataclass(frozen=True)
class CgroupStats:
    """Accounting of one cgroup; a field is ``None`` when its controller is unavailable."""

    memory_current: int | None  #: bytes charged now
    memory_peak: int | None  #: most bytes ever charged (None on v2 kernels without memory.peak)
    oom_kills: int | None  #: processes the OOM killer killed inside the group
    pids_current: int | None  #: tasks (processes and threads) in the group now
    pids_max_events: int | None  #: forks refused because the group was at pids_limit
    cpu_usage_ns: int | None  #: CPU time used by members, in nanoseconds


class Cgroup(ABC):
    """One workspace's cgroup. Get it from :meth:`CgroupBackend.create` or ``open``."""

    def __init__(self, backend: CgroupBackend, name: str) -> None:
        self.backend = backend
        self.name = name
        #: what :meth:`CgroupBackend.create` and :meth:`set_limits` wrote (a group found with
        #: ``open`` says none: its limits were set elsewhere)
        self.limits = Limits()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.dirs()}>"

    @abstractmethod
    def dirs(self) -> list[str]:
        """This group's directory in every hierarchy the backend uses."""

    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files a process writes ``"0"`` into to join the group."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs()]

    def add(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the group."""
        for path in self.procs_files():
            try:
                _fs.write(path, str(int(pid)))
            except CgroupError:
                if not os.path.exists(f"/proc/{int(pid)}"):
                    raise CgroupError(
                        f"cannot add pid {pid} to {self.name!r}: no such process"
                    ) from None
                raise

    @abstractmethod
    def pids(self) -> list[int]:
        """Host pids of every member process, including those in child groups."""

    @abstractmethod
    def freeze(self, timeout: float = 5.0) -> None:
        """Stop every member; return once all are frozen, or thaw and raise CgroupError."""

    @abstractmethod
    def thaw(self) -> None:
        """Let frozen members run again."""

    @abstractmethod
    def frozen(self) -> bool:
        """True when every member is frozen."""

    @abstractmethod
    def kill_all(self, timeout: float = 5.0) -> None:
        """SIGKILL every member, including any forked meanwhile; return once the group is empty."""

    @abstractmethod
    def stats(self) -> CgroupStats:
        """Current accounting figures."""

    @abstractmethod
    def oom_kills(self) -> int | None:
        """``stats().oom_kills`` alone: one file read, as every tool call asks it twice."""

    @abstractmethod
    def _apply(self, memory: int | None | EllipsisType, pids: int | None | EllipsisType,
               cpu: float | None | EllipsisType) -> None:
        """Write parsed limits; ``...`` leaves one unchanged, ``None`` removes it."""

    def set_limits(
        self,
        *,
        memory_limit: int | str | None | EllipsisType = ...,
        pids_limit: int | None | EllipsisType = ...,
        cpu_limit: float | None | EllipsisType = ...,
    ) -> None:
        """Change limits; an argument left out stays as it is, ``None`` removes that limit.

        Accepted forms are in :mod:`bunshin.runtime.cgroup.limits`; bad values raise LimitError
        before anything is written, a missing controller raises CgroupError.
        """
        memory = memory_limit if memory_limit is ... else parse_memory(memory_limit)
        pids = pids_limit if pids_limit is ... else parse_pids(pids_limit)
        cpu = cpu_limit if cpu_limit is ... else parse_cpu(cpu_limit)
        self._apply(memory, pids, cpu)
        self.limits = self.limits.changed(memory, pids, cpu)

    def _kill_loop(self, timeout: float) -> None:
        """Freeze, SIGKILL every member, thaw, until empty.

        Frozen tasks can neither fork nor exit, so the pids read are complete and cannot be
        reused by another process before the signal lands; the kill takes effect on thaw.
        """
        deadline = time.monotonic() + timeout
        while members := self.pids():
            if time.monotonic() >= deadline:
                raise CgroupError(
                    f"cgroup {self.name!r}: members {members} survived SIGKILL for {timeout}s "
                    f"(stuck in uninterruptible sleep?); retry destroy() or reboot"
                )
            try:
                self.freeze(timeout=min(1.0, max(deadline - time.monotonic(), 0.01)))
            except CgroupError:
                pass  # a task stuck in D state blocks freezing; kill what we can anyway
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.thaw()
            _fs.wait_for(lambda: not self.pids(), min(0.2, max(deadline - time.monotonic(), 0)))

    def destroy(self, timeout: float = 5.0) -> None:
        """Kill every member and remove the group everywhere; calling it again does nothing."""
        deadline = time.monotonic() + timeout
        # Kill again on every pass: a process may join (its init starting up) while we destroy.
        while dirs := [d for d in self.dirs() if os.path.isdir(d)]:
            self.kill_all(max(deadline - time.monotonic(), 0.1))
            removed = [_fs.rmdir_tree(d) for d in dirs]  # try every hierarchy, no short cut
            if all(removed):
                continue
            if time.monotonic() >= deadline:
                busy = {d: _fs.tree_procs(d) for d in dirs if os.path.isdir(d)}
                raise CgroupError(
                    f"cannot remove cgroup {self.name!r}: members still there after {timeout}s "
                    f"({busy}); kill them and call destroy() again"
                )
            time.sleep(0.01)
        self.backend._remove_prefix_if_empty()


class CgroupBackend(ABC):
    """Creates and finds workspace cgroups in one cgroup version's hierarchies."""

    name: str

    @abstractmethod
    def _tops(self) -> list[str]:
        """The prefix directory in every hierarchy used (whether or not it exists yet)."""

    @abstractmethod
    def _make(self, name: str) -> Cgroup:
        """Create the group's directories (the prefix exists); raise CgroupError if it exists."""

    @abstractmethod
    def _open(self, name: str) -> Cgroup | None:
        """The existing group ``name``, or None."""

    @abstractmethod
    def controllers(self) -> dict[str, bool]:
        """Which of memory, pids, freezer and cpu work here (for ``bunshin doctor``)."""

    @abstractmethod
    def memory_room(self) -> tuple[str, int, int] | None:
        """(group, limit, usage) in bytes of the prefix group's memory limit, where one is set
        (an administrator's cap on every workspace together); None otherwise."""

    def prefix(self) -> str:
        """The validated top directory name, :func:`bunshin.config.cgroup_prefix`."""
        return _fs.check_name(config.cgroup_prefix(), "BUNSHIN_CGROUP_PREFIX")

    def create(
        self,
        name: str,
        *,
        memory_limit: int | str | None = None,
        pids_limit: int | None = None,
        cpu_limit: float | None = None,
    ) -> Cgroup:
        """Create group ``name`` with the given limits (``None``: unlimited).

        Raises CgroupError if it already exists, LimitError for a bad limit, PermissionDenied
        when not root. Nothing is left behind on failure.
        """
        _fs.check_name(name)
        memory = parse_memory(memory_limit)
        pids, cpu = parse_pids(pids_limit), parse_cpu(cpu_limit)
        for attempt in range(3):
            for top in self._tops():
                _fs.mkdir(top)
            try:
                cg = self._make(name)
                break
            except CgroupError:
                # Another process's destroy() may have removed the empty prefix just now.
                if attempt == 2 or all(os.path.isdir(t) for t in self._tops()):
                    raise
        try:
            # a new group starts unlimited: write only the limits asked for (each write costs
            # tens of microseconds, and forks create a group each)
            cg._apply(_unless_none(memory), _unless_none(pids), _unless_none(cpu))
        except BaseException:
            cg.destroy()
            raise
        cg.limits = Limits(memory, pids, cpu)
        return cg

    def open(self, name: str) -> Cgroup:
        """The existing group ``name`` (for forks and ``bunshin gc``); CgroupError if absent."""
        cg = self._open(_fs.check_name(name))
        if cg is None:
            raise CgroupError(
                f"no cgroup {name!r} under {self._tops()}; list() shows the existing ones"
            )
        return cg

    def remove_freezer_on(self) -> bool:
        """Remove what the backend keeps between workspaces to make freezing cheap, once no
        Bunshin group is left (``bunshin gc``); whether something was removed. Only v1 keeps
        anything (v1.py says why)."""
        return False

    def list(self) -> list[str]:
        """Names of the groups under the prefix, in any hierarchy (for ``bunshin gc``)."""
        names: set[str] = set()
        for top in self._tops():
            try:
                names.update(e.name for e in os.scandir(top) if e.is_dir())
            except FileNotFoundError:
                pass
            except OSError as e:
                raise _fs.translate(e, "listing cgroups") from None
        return sorted(names)

    def _remove_prefix_if_empty(self) -> None:
        for top in self._tops():
            try:
                os.rmdir(top)
            except OSError:
                pass  # still in use by other groups, or already gone


def _unless_none(limit: _T | None) -> _T | EllipsisType:
    """A limit as :meth:`Cgroup._apply` takes it when only the ones asked for are written."""
    return ... if limit is None else limit
