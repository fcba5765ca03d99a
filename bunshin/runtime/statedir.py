"""On-disk state of live workspaces: ``<state_dir>/ws/<id>/{layer/{upper,work},root,meta.json,init.log}``,
and ``frozen-*/upper``, the copies of the upper layer its children see as they were at a fork.

``meta.json`` names the owning process (pid + start time, so a recycled pid is not mistaken
for the owner); ``bunshin gc`` removes what an owner that died without closing left behind.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from .. import config
from . import layers, quota

log = logging.getLogger("bunshin.state")


def proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


_own_start: tuple[int, int] = (0, 0)


def own_start_time() -> int:
    """:func:`proc_start_time` of this process, read once per process (a forked trainer reads
    its own)."""
    global _own_start
    pid = os.getpid()
    if _own_start[0] != pid:
        _own_start = (pid, proc_start_time(pid) or 0)
    return _own_start[1]


@dataclass
class Meta:
    id: str
    owner_pid: int
    owner_start: int
    init_pid: int = 0
    cgroup: str = ""
    rootfs: str = ""
    lowers: list[str] = field(default_factory=list)
    parent: str | None = None


class WorkspaceDir:
    """The directory of one workspace."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # upper and work in one layer (a btrfs subvolume): a fork freezes a copy of it whole
        self.layer = path / "layer"
        self.upper = self.layer / "upper"
        self.work = self.layer / "work"
        self.root = path / "root"
        self.meta_file = path / "meta.json"
        self.log_file = path / "init.log"

    @property
    def id(self) -> str:
        return self.path.name

    @classmethod
    def create(cls, disk_limit: int | None = None) -> WorkspaceDir:
        """A new directory whose layer holds at most ``disk_limit`` bytes written (None: no
        bound; runtime/quota.py)."""
        from . import statefs

        base = statefs.ensure() / "ws"
        base.mkdir(parents=True, exist_ok=True)
        while True:
            path = base / secrets.token_hex(6)
            try:
                path.mkdir(mode=0o700)
                break
            except FileExistsError:
                continue
        d = cls(path)
        try:
            layers.make(d.layer)
            quota.limit(d.layer, disk_limit)
            for p in (d.upper, d.work, d.root):
                p.mkdir()
        except BaseException:
            d.remove()
            raise
        os.chmod(d.upper, 0o755)
        return d

    def frozen_path(self) -> Path:
        """Where a read-only copy of the upper layer goes (layers.freeze): its ``upper`` is the
        lower layer of this workspace's children, and it goes with the directory."""
        while True:
            path = self.path / f"frozen-{secrets.token_hex(4)}"
            if not path.exists():
                return path

    def write_meta(self, meta: Meta) -> None:
        tmp = self.meta_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(vars(meta)))  # flat, JSON-ready fields: no asdict() deep copy
        os.replace(tmp, self.meta_file)

    def read_meta(self) -> Meta | None:
        try:
            return Meta(**json.loads(self.meta_file.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def remove(self) -> None:
        try:
            for p in self.path.iterdir():
                if p.name == "layer" or p.name.startswith("frozen-"):
                    layers.remove(p)  # a read-only snapshot cannot be emptied file by file
        except OSError:
            pass
        # overlay's workdir holds root-owned 000-mode dirs; rmtree copes as root.
        shutil.rmtree(self.path, ignore_errors=True)
        if self.path.exists():
            log.warning("could not remove %s completely", self.path)


def all_dirs() -> list[WorkspaceDir]:
    base = config.state_dir() / "ws"
    try:
        return [WorkspaceDir(p) for p in sorted(base.iterdir()) if p.is_dir()]
    except FileNotFoundError:
        return []


def owner_alive(meta: Meta) -> bool:
    return proc_start_time(meta.owner_pid) == meta.owner_start
