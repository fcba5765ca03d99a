"""A workspace's live parts (:class:`Body`) and the one way their host-side pieces are made
(:func:`allocate`).

A :class:`~bunshin.runtime.workspace.Workspace` is a handle on one body at a time: creating
it starts one, forking makes more (bunshin/fork/), a CRIU restore rebuilds one from images
(bunshin/criu/), and a rollback swaps the handle's body for another.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from .. import config
from ..errors import BunshinError
from . import cgroup as _cgroup
from . import headroom, layers, quota, statefs, trainer
from .cgroup.limits import Limits
from .reap import reap_init
from .statedir import Meta, WorkspaceDir, own_start_time

if TYPE_CHECKING:
    from ..fork.template import TemplateCore
    from .cgroup.base import Cgroup
    from .channel import Channel
    from .rootfs.model import Rootfs
    from .userns import UserNs

__all__ = ["Allocation", "Body", "SessionCopy", "allocate", "remove_parts", "session_copies"]

log = logging.getLogger("bunshin.workspace")

_O_PATH = getattr(os, "O_PATH", 0o10000000)
_holds_lock = threading.Lock()


@dataclass(eq=False)
class Allocation:
    """A workspace's host-side pieces before any process: its state directory (with a meta
    file naming this process as owner) and its cgroup."""

    dir: WorkspaceDir
    cgroup: Cgroup
    meta: Meta

    def destroy(self) -> None:
        remove_parts(self.dir, self.cgroup)


def remove_parts(d: WorkspaceDir, cg: Cgroup, what: str = "workspace") -> None:
    """Remove a cgroup and state directory that no process uses any more; a cgroup that cannot
    go is logged, and the directory goes all the same."""
    try:
        cg.destroy()
    except BunshinError as e:
        log.warning("%s %s: %s", what, d.id, e)
    d.remove()


def allocate(limits: Limits, *, rootfs: str, lowers: Iterable[str] = (),
             parent: str | None = None, disk_limit: int | None = None) -> Allocation:
    """A new state directory (its layer holding at most ``disk_limit`` bytes written), its
    meta file and a cgroup with ``limits``; on failure nothing is left. The meta file is
    written first, so that `bunshin gc` elsewhere leaves the pieces
    alone while this process lives and removes them after it dies."""
    trainer.prepare()
    state = config.state_dir()
    headroom.check(state, statefs.image_path(state))
    try:
        d = WorkspaceDir.create(disk_limit)
    except OSError as e:
        if e.errno == errno.EDQUOT:
            raise quota.all_full(state) from None
        if e.errno == errno.ENOSPC:
            raise headroom.no_space(state) from None
        raise
    cg = None
    try:
        meta = Meta(id=d.id, owner_pid=os.getpid(), owner_start=own_start_time(),
                    cgroup=f"ws-{d.id}", rootfs=rootfs, lowers=list(lowers), parent=parent)
        d.write_meta(meta)
        cg = _cgroup.backend().create(meta.cgroup, **limits.to_dict())
        return Allocation(d, cg, meta)
    except BaseException:
        if cg is not None:
            cg.destroy()
        d.remove()
        raise


@dataclass(eq=False)
class Body:
    """The live parts of one workspace: its directory, cgroup and meta file, its init (pid,
    pidfd, control channel), a handle on its root, the rootfs it says it runs, and the
    template it is a fork of (None for a created or restored one)."""

    dir: WorkspaceDir
    cgroup: Cgroup
    meta: Meta
    rootfs: Rootfs
    init_pid: int = 0
    pidfd: int = -1
    init_is_child: bool = True  # a forked init is its template's init's child, not ours
    channel: Channel | None = None
    root_fd: int = -1  # O_PATH of the init's root: files are opened beneath it
    template: TemplateCore | None = None  # holds one reference, given back at close
    # Forks of this body whose children live: their pid namespaces are below its init's, and
    # would die with it. Closed meanwhile, it stays frozen until the last of them goes.
    holds: int = 0
    closing: bool = False
    # isolation="sandbox": the user namespace it and its forks run in (runtime/userns.py)
    userns: UserNs | None = None

    def __post_init__(self) -> None:
        if self.userns is not None:
            self.userns.acquire()

    @property
    def id(self) -> str:
        return self.dir.id

    def open_root(self) -> None:
        self.root_fd = os.open(f"/proc/{self.init_pid}/root", _O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def hold(self) -> None:
        with _holds_lock:
            self.holds += 1

    def unhold(self, layer: Path | None = None) -> None:
        """A fork's children are gone; ``layer``, the copy of the upper layer made for them,
        goes too. Closes a body that was closed meanwhile."""
        if layer is not None:
            try:
                layers.remove(layer)
            except OSError as e:
                log.warning("workspace %s: cannot remove %s: %s", self.id, layer, e)
        with _holds_lock:
            self.holds -= 1
            due = self.holds == 0 and self.closing
        if due:
            self._close(frozen=True)

    def close(self, *, frozen: bool = False) -> None:
        """End the init (and with it every process: its pid namespace goes), remove the cgroup
        and directory, give back the template. ``frozen``: the processes are stopped in the
        freezer (a template's), so the init is not asked to shut down but killed. While a
        fork's children live (``holds``) it is frozen instead, and ends after them."""
        with _holds_lock:
            held, self.closing = self.holds > 0, True
            if held:  # under the lock: the last unhold cannot have ended it meanwhile
                try:
                    self.cgroup.freeze()
                except BunshinError as e:
                    log.warning("workspace %s: %s", self.id, e)
                return
        self._close(frozen)

    def _close(self, frozen: bool) -> None:
        if self.channel is not None:
            if frozen:
                self.channel.close()
            else:
                self.channel.shutdown()
        if frozen:
            try:
                self.cgroup.kill_all()
            except BunshinError as e:
                log.warning("template %s: %s", self.id, e)
        try:
            if self.pidfd >= 0:
                # Init's exit tears down the pid namespace: the kernel kills and reaps every member.
                # A forked init is reaped by its template's init, not us.
                pidfd, self.pidfd = self.pidfd, -1
                reap_init(pidfd, is_child=self.init_is_child, grace=0 if frozen else 5)
        finally:
            # Each part goes even when one before it fails (a member the cgroup cannot lose):
            # the template's reference above all, else its frozen processes stay for good.
            try:
                if self.root_fd >= 0:
                    os.close(self.root_fd)
                    self.root_fd = -1
                try:
                    self.cgroup.destroy()
                finally:
                    self.dir.remove()
            finally:
                if self.template is not None:
                    template, self.template = self.template, None
                    template.release()
                if self.userns is not None:
                    userns, self.userns = self.userns, None
                    userns.release()


class SessionCopy(NamedTuple):
    """A shell session a forked or restored body holds, as its Workspace's Shell takes it."""

    master: int  # the trainer's end of its terminal
    pid: int  # its bash, by pid in the workspace
    id: str  # the session's, shared with the one it copies (its marker nonce)


def session_copies(sessions: Iterable[tuple[int, int, str]], masters: dict[int, int]) -> list[SessionCopy]:
    """The copies of ``sessions`` ((pty index, bash pid, id) of the source's, in its order) that
    have a terminal in ``masters`` (pty index -> master fd)."""
    return [SessionCopy(masters[idx], pid, sid) for idx, pid, sid in sessions if idx in masters]
