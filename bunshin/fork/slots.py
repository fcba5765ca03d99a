"""The host-side pieces of a template's next children, made ahead of time.

Every child needs a state directory, a cgroup (with the template's limits) and its overlay root
(the template's layers under a fresh upper) before anything is cloned: ~0.7 ms of mkdirs,
cgroup writes and mount syscalls per child. None of it depends on the moment of the fork, so
after ``tpl.fork(n)`` one background thread makes ``n`` (at most ``MAX``) of them for that
template's next call, which takes them instead of making its own. Only templates the user
holds are served (``Template.fork``): ``ws.fork()``'s template is never forked again.

``ws.fork()`` and ``ws.snapshot()`` make a new template each time, which has no slots: after
one, the same thread makes *spares* for that workspace's next call, the pieces that do not
depend on the template (directory and cgroup; ~0.8 ms of the ~1.1 ms a slot costs here); the
overlay root is mounted at the fork. The workspace owns its spares; closing it removes them.

A slot's or spare's directory carries a meta file naming this process as owner (no init
yet), so ``bunshin gc`` from elsewhere leaves it alone while we live and removes it after we
die. ``BUNSHIN_FORK_SLOTS=0`` turns both off.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import config
from ..runtime.body import allocate, remove_parts
from ..runtime.cgroup.limits import Limits
from . import engine
from .perprocess import PerProcess

if TYPE_CHECKING:
    from .earlyinit import EarlyInit
    from ..runtime.cgroup.base import Cgroup
    from ..runtime.statedir import WorkspaceDir
    from .template import TemplateCore

log = logging.getLogger("bunshin.fork")

MAX = 8


@dataclass
class Spare:
    """A state directory and a cgroup with a workspace's limits: a slot without its root."""

    dir: WorkspaceDir
    cg: Cgroup

    def destroy(self) -> None:
        remove_parts(self.dir, self.cg, "slot")


@dataclass
class Slot(Spare):
    mount_fd: int  # the detached overlay root (closing it unmounts it); -1 once an init has it
    early: EarlyInit | None = None  # the child's init, cloned ahead (earlyinit.py)

    def destroy(self) -> None:
        if self.early is not None:
            self.early.discard()
            self.early = None
        if self.mount_fd >= 0:
            try:
                os.close(self.mount_fd)
            except OSError:
                pass
        super().destroy()


def _spare(limits: Limits, rootfs: str, lowers: list[str], parent: str | None,
           disk_limit: int | None = None) -> Spare:
    a = allocate(limits, rootfs=rootfs, lowers=lowers, parent=parent, disk_limit=disk_limit)
    return Spare(a.dir, a.cgroup)


def make(core: TemplateCore) -> Slot:
    """A state directory, cgroup and overlay root for one child of ``core``: made ahead by the
    thread, or by a fork that finds none ready (from a spare of the forked workspace when it
    has one). On failure nothing is left."""
    sp = core.spares.take() if core.spares is not None else None
    if sp is None:
        sp = _spare(core.config.limits, "slot", [str(p) for p in core.lowers], core.id,
                    core.config.disk_limit)
    try:
        return Slot(sp.dir, sp.cg, engine.overlay_fd(core.lowers, sp.dir.upper, sp.dir.work,
                                                 core.body.userns))
    except BaseException:
        sp.destroy()
        raise


class Holder:
    """What the thread serves: ``make_slot()`` makes one; ``slots`` holds those made, under
    ``lock``, until :meth:`close_slots`."""

    id: str
    lock: threading.Lock
    slots: list
    slots_closed: bool

    def make_slot(self) -> Spare:
        raise NotImplementedError

    def _taking(self) -> bool:
        """Whether a slot made now would still be used (called with the lock held)."""
        return not self.slots_closed

    def add_slot(self, s: Spare) -> bool:
        with self.lock:
            if not self._taking():
                return False
            self.slots.append(s)
            return True

    def close_slots(self) -> None:
        """No more calls will take them: drop the slots made."""
        with self.lock:
            self.slots_closed = True
            ready, self.slots = self.slots, []
        for s in ready:
            s.destroy()


class Spares(Holder):
    """The spares of one workspace (see the module's docstring)."""

    def __init__(self, limits: Limits, owner: str, disk_limit: int | None = None) -> None:
        self.limits, self.id, self.disk_limit = limits, owner, disk_limit
        self.lock = threading.Lock()
        self.slots: list[Spare] = []
        self.slots_closed = False

    def make_slot(self) -> Spare:
        return _spare(self.limits, "spare", [], None, self.disk_limit)

    def take(self) -> Spare | None:
        with self.lock:
            return self.slots.pop() if self.slots else None


def enabled() -> bool:
    return config.fork_slots()


class Maker:
    """One daemon thread making slots for the templates that asked, one at a time."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._want: dict[int, tuple[Holder, int]] = {}
        self._thread: threading.Thread | None = None

    def request(self, core: Holder, n: int) -> None:
        """Have ``min(n, MAX)`` slots (spares) ready for ``core``'s next fork call."""
        with self._cv:
            self._want[id(core)] = (core, min(n, MAX))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="bunshin-slots", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _next(self) -> Holder:
        with self._cv:
            while True:
                for key, (core, n) in list(self._want.items()):
                    if core.slots_closed or len(core.slots) >= n:
                        del self._want[key]
                    else:
                        return core
                self._cv.wait()

    def _run(self) -> None:
        while True:
            core = self._next()
            try:
                s = core.make_slot()
            except BaseException as e:  # noqa: BLE001 - the fork makes its own instead
                log.warning("making a slot for %s: %s", core.id, e)
                with self._cv:
                    self._want.pop(id(core), None)
                continue
            if not core.add_slot(s):
                s.destroy()


_maker = PerProcess(Maker)


def request(core: Holder, n: int) -> None:
    """Ask for slots (spares) for ``core`` (no-op when turned off)."""
    if not enabled():
        return
    maker = _maker.get()
    assert maker is not None  # Maker() is never None
    maker.request(core, n)
