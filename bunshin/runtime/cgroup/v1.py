"""cgroup v1: one directory per hierarchy (memory, pids, freezer, cpu, cpuacct — whichever is
mounted), found in /proc/self/mountinfo.

Groups are made under each hierarchy's root, not under the caller's own cgroup, so a workspace
is accounted apart from the process that manages it. Choices made here:

* ``memory.oom_control``: a new group inherits ``oom_kill_disable`` from its parent; it is forced
  to 0 so an OOM inside the group kills a process inside the group instead of hanging it.
* swap: ``memory_limit`` bounds memory plus swap (``memory.memsw.limit_in_bytes`` follows
  ``memory.limit_in_bytes`` when swap accounting exists), so a workspace cannot grow past its
  limit by swapping and the limit means the same on hosts with and without swap, and on v2.
  ``memory.swappiness`` is left alone: with memsw capped it no longer decides the outcome.
* ``memory.use_hierarchy`` is always 1 on current kernels, so child groups count towards their
  parent's limit; nothing to set.
* the freezer is kept switched on: the v1 freezer flips a kernel static key (text patched on
  every CPU) each time the number of freezing groups goes from 0 to 1 and back, ~90 us of a
  write to ``freezer.state`` here. A fork thaws and refreezes its template, so a trainer with one
  template paid it twice a fork. One empty group, ``bunshin-freezer-on`` at the freezer root,
  is kept frozen: the key stays on and a freeze or thaw write takes ~8 us. It holds no process
  and is shared by every Bunshin on the machine, so it is left in place (``bunshin gc``
  removes it when it finds no Bunshin group at all). ``BUNSHIN_FREEZER_ON=0`` does without.
"""

from __future__ import annotations

import logging
import os
import signal
from types import EllipsisType

from ... import config
from ...errors import CgroupError, UnsupportedKernel
from . import _fs
from .base import Cgroup, CgroupBackend, CgroupStats
from .limits import CPU_PERIOD_US, cpu_quota_us

__all__ = ["V1Backend", "V1Cgroup"]

_USED = ("freezer", "memory", "pids", "cpu", "cpuacct")
_MOUNT_HINT = "mount -t cgroup -o {c} cgroup /sys/fs/cgroup/{c}"
FREEZER_ON = "bunshin-freezer-on"

log = logging.getLogger("bunshin.cgroup")


class V1Backend(CgroupBackend):
    """cgroup v1 hierarchies; needs at least the freezer (forks freeze their source)."""

    name = "v1"

    def __init__(self, mountinfo: str = "/proc/self/mountinfo") -> None:
        self.mounts: dict[str, str] = {}  # controller -> mount point of its hierarchy
        for m in _fs.cgroup_mounts(mountinfo):
            if m.fstype != "cgroup":
                continue
            for c in m.options.intersection(_USED):
                # A hierarchy may be mounted twice; the mount of its root sees every group.
                if c not in self.mounts or m.root == "/":
                    self.mounts[c] = m.point
        if "freezer" not in self.mounts:
            raise UnsupportedKernel(
                "no cgroup v1 freezer hierarchy in /proc/self/mountinfo; Bunshin freezes "
                f"workspaces to fork them: {_MOUNT_HINT.format(c='freezer')}, or use cgroup v2"
            )
        self._freezer_on = False

    def keep_freezer_on(self) -> None:
        """Have the empty group that keeps the freezer's static key on exist, frozen (see the
        module's docstring; ``BUNSHIN_FREEZER_ON=0`` does without). Failing only costs speed,
        so it is logged, not raised."""
        if not config.freezer_on():
            return
        d = os.path.join(self.mounts["freezer"], FREEZER_ON)
        if self._freezer_on and os.path.isdir(d):  # a gc elsewhere may have removed it
            return
        self._freezer_on = True
        try:
            _fs.mkdir(d)
            _fs.write(os.path.join(d, "freezer.state"), "FROZEN")
        except (OSError, CgroupError) as e:
            log.info("cannot keep %s frozen (each freeze and thaw costs ~90 us more): %s", d, e)

    def memory_room(self) -> tuple[str, int, int] | None:
        if "memory" not in self.mounts:
            return None
        top = os.path.join(self.mounts["memory"], self.prefix())
        try:
            limit = int(_fs.read(os.path.join(top, "memory.limit_in_bytes")))
            usage = int(_fs.read(os.path.join(top, "memory.usage_in_bytes")))
        except (OSError, ValueError, CgroupError):  # not made yet
            return None
        return None if limit >= 1 << 62 else (top, limit, usage)  # "no limit" is ~2**63

    def remove_freezer_on(self) -> bool:
        """Remove the empty frozen group (``bunshin gc``, when no Bunshin group is left)."""
        try:
            os.rmdir(os.path.join(self.mounts["freezer"], FREEZER_ON))
            return True
        except OSError:
            return False

    def _points(self) -> list[str]:
        return list(dict.fromkeys(self.mounts.values()))

    def _tops(self) -> list[str]:
        return [os.path.join(p, self.prefix()) for p in self._points()]

    def _dirs(self, name: str) -> dict[str, str]:
        return {c: os.path.join(p, self.prefix(), name) for c, p in self.mounts.items()}

    def _make(self, name: str) -> V1Cgroup:
        dirs = self._dirs(name)
        made = []
        try:
            for d in dict.fromkeys(dirs.values()):
                if not _fs.mkdir(d):
                    raise CgroupError(
                        f"cgroup {d} already exists; open() it, or destroy() it first "
                        f"(`bunshin gc` removes groups of dead workspaces)"
                    )
                made.append(d)
            if "memory" in dirs:
                oom = os.path.join(dirs["memory"], "memory.oom_control")
                if _fs.read_keyed(oom).get("oom_kill_disable"):
                    _fs.write(oom, "0")
        except BaseException:
            for d in reversed(made):
                _fs.rmdir_tree(d)
            raise
        return V1Cgroup(self, name, dirs)

    def _open(self, name: str) -> V1Cgroup | None:
        dirs = self._dirs(name)
        if not any(os.path.isdir(d) for d in dirs.values()):
            return None
        return V1Cgroup(self, name, dirs)

    def controllers(self) -> dict[str, bool]:
        return {c: c in self.mounts for c in ("memory", "pids", "freezer", "cpu")}


class V1Cgroup(Cgroup):
    """A workspace's group in each v1 hierarchy; members are read from the freezer one."""

    def __init__(self, backend: V1Backend, name: str, dirs: dict[str, str]) -> None:
        super().__init__(backend, name)
        self._v1 = backend
        self._by = dirs

    def dirs(self) -> list[str]:
        return list(dict.fromkeys(self._by.values()))

    def _file(self, controller: str, file: str, arg: str | None = None) -> str:
        d = self._by.get(controller)
        if d is None:
            want = f"{arg} needs" if arg else "this needs"
            raise CgroupError(
                f"{want} the cgroup v1 '{controller}' hierarchy, which is not mounted; "
                f"{_MOUNT_HINT.format(c=controller)}" + (f", or pass {arg}=None" if arg else "")
            )
        return os.path.join(d, file)

    def pids(self) -> list[int]:
        return _fs.tree_procs(self._by["freezer"])

    def _all_pids(self) -> list[int]:
        return sorted({p for d in self.dirs() for p in _fs.tree_procs(d)})

    def freeze(self, timeout: float = 5.0) -> None:
        self._v1.keep_freezer_on()
        state = self._file("freezer", "freezer.state")
        _fs.write(state, "FROZEN")
        if not _fs.wait_for(lambda: _fs.read(state) == "FROZEN", timeout):
            self.thaw()
            raise CgroupError(
                f"cgroup {self.name!r} did not freeze within {timeout}s (members "
                f"{self.pids()}); a task may be stuck in uninterruptible sleep, retry later"
            )

    def thaw(self) -> None:
        """Thaw the group and any child group frozen on its own, which would survive a kill."""
        top = self._file("freezer", "freezer.state")
        _fs.write(top, "THAWED")
        for d, _, _ in os.walk(os.path.dirname(top)):
            state = os.path.join(d, "freezer.state")
            if state != top and _fs.read(state) != "THAWED":
                _fs.write(state, "THAWED")

    def frozen(self) -> bool:
        return _fs.read(self._file("freezer", "freezer.state")) == "FROZEN"

    def kill_all(self, timeout: float = 5.0) -> None:
        if os.path.isdir(self._by["freezer"]):
            self._kill_loop(timeout)
        # A task moved into only some hierarchies is not seen by the freezer; kill it too.
        for pid in self._all_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _apply(self, memory: int | None | EllipsisType, pids: int | None | EllipsisType,
               cpu: float | None | EllipsisType) -> None:
        if memory is not ... and (memory is not None or "memory" in self._by):
            self._set_memory(memory)
        if pids is not ... and (pids is not None or "pids" in self._by):
            _fs.write(self._file("pids", "pids.max", "pids_limit"),
                      "max" if pids is None else str(pids), limit="pids_limit")
        if cpu is not ... and (cpu is not None or "cpu" in self._by):
            _fs.write(self._file("cpu", "cpu.cfs_period_us", "cpu_limit"), str(CPU_PERIOD_US),
                      limit="cpu_limit")
            _fs.write(self._file("cpu", "cpu.cfs_quota_us", "cpu_limit"),
                      "-1" if cpu is None else str(cpu_quota_us(cpu)), limit="cpu_limit")

    def _set_memory(self, memory: int | None) -> None:
        mem = self._file("memory", "memory.limit_in_bytes", "memory_limit")
        memsw = self._file("memory", "memory.memsw.limit_in_bytes")
        value = "-1" if memory is None else str(memory)
        order = [mem]
        if os.path.exists(memsw):
            # The kernel keeps memsw >= mem at every step, so raise memsw first, lower it last.
            grow = memory is None or memory > int(_fs.read(mem))
            order = [memsw, mem] if grow else [mem, memsw]
        for path in order:
            _fs.write(path, value, limit="memory_limit")

    def oom_kills(self) -> int | None:
        if "memory" not in self._by:
            return None
        return _fs.read_keyed(os.path.join(self._by["memory"], "memory.oom_control")).get("oom_kill")

    def stats(self) -> CgroupStats:
        def get(c: str, f: str) -> int | None:
            return int(_fs.read(os.path.join(self._by[c], f))) if c in self._by else None

        def key(c: str, f: str, k: str) -> int | None:
            return _fs.read_keyed(os.path.join(self._by[c], f)).get(k) if c in self._by else None

        return CgroupStats(
            memory_current=get("memory", "memory.usage_in_bytes"),
            memory_peak=get("memory", "memory.max_usage_in_bytes"),
            oom_kills=key("memory", "memory.oom_control", "oom_kill"),
            pids_current=get("pids", "pids.current"),
            pids_max_events=key("pids", "pids.events", "max"),
            cpu_usage_ns=get("cpuacct", "cpuacct.usage"),
        )
