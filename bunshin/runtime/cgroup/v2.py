"""cgroup v2: one directory in the unified hierarchy, found in /proc/self/mountinfo.

Freezing (``cgroup.freeze``) and killing (``cgroup.kill``) are core v2 features that need no
controller, so they work even where every controller is bound to v1 (hybrid hosts). Limits need
the memory, pids and cpu controllers: they are enabled in ``cgroup.subtree_control`` of the root
and of the prefix directory when the hierarchy offers them. ``memory_limit`` also sets
``memory.swap.max`` to 0, so the limit bounds memory plus swap as on the v1 backend.
"""

from __future__ import annotations

import os
from types import EllipsisType

from ...errors import CgroupError, UnsupportedKernel
from . import _fs
from .base import Cgroup, CgroupBackend, CgroupStats
from .limits import CPU_PERIOD_US, cpu_quota_us

__all__ = ["V2Backend", "V2Cgroup"]

_LIMITED = ("memory", "pids", "cpu")


class V2Backend(CgroupBackend):
    """The cgroup2 (unified) hierarchy."""

    name = "v2"

    def __init__(self, mountinfo: str = "/proc/self/mountinfo") -> None:
        mounts = [m for m in _fs.cgroup_mounts(mountinfo) if m.fstype == "cgroup2"]
        if not mounts:
            raise UnsupportedKernel(
                "no cgroup2 mount in /proc/self/mountinfo; mount it "
                "(mount -t cgroup2 none /sys/fs/cgroup/unified) or use BUNSHIN_CGROUP=v1"
            )
        self.root = next((m.point for m in mounts if m.root == "/"), mounts[0].point)
        self._probed: dict[str, bool] | None = None

    def available(self) -> set[str]:
        """Controllers the hierarchy's root offers (not bound to a v1 hierarchy)."""
        return set(_fs.read(os.path.join(self.root, "cgroup.controllers")).split())

    def _tops(self) -> list[str]:
        return [os.path.join(self.root, self.prefix())]

    def memory_room(self) -> tuple[str, int, int] | None:
        top = os.path.join(self.root, self.prefix())
        try:
            limit = _fs.read(os.path.join(top, "memory.max")).strip()
            usage = int(_fs.read(os.path.join(top, "memory.current")))
        except (OSError, ValueError, CgroupError):  # not made yet, or no memory controller there
            return None
        return None if limit == "max" else (top, int(limit), usage)

    def _enable(self, d: str) -> None:
        offered = set(_fs.read(os.path.join(d, "cgroup.controllers")).split())
        enabled = set(_fs.read(os.path.join(d, "cgroup.subtree_control")).split())
        for c in offered.intersection(_LIMITED) - enabled:
            try:
                _fs.write(os.path.join(d, "cgroup.subtree_control"), f"+{c}")
            except CgroupError:
                pass  # e.g. cpu with realtime tasks around; set_limits names what is missing

    def _make(self, name: str) -> V2Cgroup:
        top = self._tops()[0]
        for d in (self.root, top):
            self._enable(d)
        d = os.path.join(top, name)
        if not _fs.mkdir(d):
            raise CgroupError(
                f"cgroup {d} already exists; open() it, or destroy() it first "
                f"(`bunshin gc` removes groups of dead workspaces)"
            )
        return V2Cgroup(self, name, d)

    def _open(self, name: str) -> V2Cgroup | None:
        d = os.path.join(self._tops()[0], name)
        return V2Cgroup(self, name, d) if os.path.isdir(d) else None

    def controllers(self) -> dict[str, bool]:
        if self._probed is None:
            # Only a non-root group shows cgroup.freeze, so look at a short-lived one.
            probe = os.path.join(self.root, f"{self.prefix()}-probe-{os.getpid()}")
            _fs.mkdir(probe)
            try:
                freezer = os.path.exists(os.path.join(probe, "cgroup.freeze"))
            finally:
                _fs.rmdir_tree(probe)
            offered = self.available()
            self._probed = {c: c in offered for c in ("memory", "pids", "cpu")}
            self._probed["freezer"] = freezer
        return {c: self._probed[c] for c in ("memory", "pids", "freezer", "cpu")}


class V2Cgroup(Cgroup):
    """A workspace's group in the unified hierarchy."""

    backend: V2Backend

    def __init__(self, backend: V2Backend, name: str, path: str) -> None:
        super().__init__(backend, name)
        self.path = path

    def dirs(self) -> list[str]:
        return [self.path]

    def _f(self, file: str) -> str:
        return os.path.join(self.path, file)

    def _events(self) -> dict[str, int]:
        return _fs.read_keyed(self._f("cgroup.events"))

    def pids(self) -> list[int]:
        return _fs.tree_procs(self.path)

    def freeze(self, timeout: float = 5.0) -> None:
        _fs.write(self._f("cgroup.freeze"), "1")
        if not _fs.wait_for(self.frozen, timeout):
            self.thaw()
            raise CgroupError(
                f"cgroup {self.name!r} did not freeze within {timeout}s (members "
                f"{self.pids()}); a task may be stuck in uninterruptible sleep, retry later"
            )

    def thaw(self) -> None:
        # Nothing to wait for: the write clears every member's freeze trap and wakes it
        # before it returns (cgroup_freeze_task), and "frozen 0" is in cgroup.events by
        # then. A fork thaws a held template on its way (~2 ms of reading cgroup.events
        # under QEMU/TCG).
        _fs.write(self._f("cgroup.freeze"), "0")

    def frozen(self) -> bool:
        return self._events().get("frozen") == 1

    def kill_all(self, timeout: float = 5.0) -> None:
        if not os.path.isdir(self.path):
            return
        if not os.path.exists(self._f("cgroup.kill")):
            self._kill_loop(timeout)  # kernels before 5.14
            return
        # cgroup.kill is atomic against concurrent forks: nothing can escape it.
        _fs.write(self._f("cgroup.kill"), "1")
        if not _fs.wait_for(lambda: not self._events().get("populated"), timeout):
            raise CgroupError(
                f"cgroup {self.name!r}: members {self.pids()} survived cgroup.kill for "
                f"{timeout}s (stuck in uninterruptible sleep?); retry destroy() later"
            )

    def _need(self, controller: str, arg: str) -> None:
        have = set(_fs.read(self._f("cgroup.controllers")).split())
        if controller not in have:
            raise CgroupError(
                f"{arg} needs the cgroup v2 '{controller}' controller, which is not enabled for "
                f"{self.path} (enabled: {sorted(have) or 'none'}); if it is bound to a v1 "
                f"hierarchy use BUNSHIN_CGROUP=v1, else enable it in "
                f"{self.backend.root}/cgroup.subtree_control; or pass {arg}=None"
            )

    def _apply(self, memory: int | None | EllipsisType, pids: int | None | EllipsisType,
               cpu: float | None | EllipsisType) -> None:
        if memory is not None and memory is not ...:
            self._need("memory", "memory_limit")
        if pids is not None and pids is not ...:
            self._need("pids", "pids_limit")
        if cpu is not None and cpu is not ...:
            self._need("cpu", "cpu_limit")
        if memory is not ... and os.path.exists(self._f("memory.max")):
            _fs.write(self._f("memory.max"), "max" if memory is None else str(memory),
                      limit="memory_limit")
            if os.path.exists(self._f("memory.swap.max")):
                _fs.write(self._f("memory.swap.max"), "max" if memory is None else "0",
                          limit="memory_limit")
        if pids is not ... and os.path.exists(self._f("pids.max")):
            _fs.write(self._f("pids.max"), "max" if pids is None else str(pids),
                      limit="pids_limit")
        if cpu is not ... and os.path.exists(self._f("cpu.max")):
            quota = "max" if cpu is None else str(cpu_quota_us(cpu))
            _fs.write(self._f("cpu.max"), f"{quota} {CPU_PERIOD_US}", limit="cpu_limit")

    def oom_kills(self) -> int | None:
        try:
            return _fs.read_keyed(self._f("memory.events")).get("oom_kill")
        except FileNotFoundError:  # no memory controller in the group
            return None

    def stats(self) -> CgroupStats:
        def get(f: str) -> int | None:
            p = self._f(f)
            return int(_fs.read(p)) if os.path.exists(p) else None

        def key(f: str, k: str) -> int | None:
            p = self._f(f)
            return _fs.read_keyed(p).get(k) if os.path.exists(p) else None

        usec = key("cpu.stat", "usage_usec")
        return CgroupStats(
            memory_current=get("memory.current"),
            memory_peak=get("memory.peak"),
            oom_kills=key("memory.events", "oom_kill"),
            pids_current=get("pids.current"),
            pids_max_events=key("pids.events", "max"),
            cpu_usage_ns=None if usec is None else usec * 1000,
        )
