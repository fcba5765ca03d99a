"""The host-side pieces of a template's next children, made ahead of time.

Every child needs a state directory, a cgroup (with the template's limits) and its overlay root
(the template's layers under a fresh upper) before anything is cloned: ~0.7 ms of mkdirs,
cgroup writes and mount syscalls per child. None of it depends on the moment of the fork, so
after ``tpl.fork(n)`` one background thread makes ``n`` (at most ``MAX``) of them for that
template's next call, which takes them instead of making its own. Only templates the user
holds are served (``Template.fork``): ``ws.fork()``'s template is never forked again.

A slot's directory carries a meta file naming this process as owner (no init yet), so
``bunshin gc`` from elsewhere leaves it alone while we live and removes it after we die.
``BUNSHIN_FORK_SLOTS=0`` turns this off.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import BunshinError
from .perprocess import PerProcess

if TYPE_CHECKING:
    from ..runtime.cgroup.base import Cgroup
    from ..runtime.state import WorkspaceDir
    from .template import TemplateCore

log = logging.getLogger("bunshin.fork")

MAX = 8


@dataclass
class Slot:
    dir: "WorkspaceDir"
    cg: "Cgroup"
    mount_fd: int  # the detached overlay root (closing it unmounts it)

    def destroy(self) -> None:
        try:
            os.close(self.mount_fd)
        except OSError:
            pass
        try:
            self.cg.destroy()
        except BunshinError as e:
            log.warning("slot %s: %s", self.dir.id, e)
        self.dir.remove()


def make(core: "TemplateCore") -> Slot:
    """A state directory, cgroup and overlay root for one child of ``core``: made ahead by the
    thread, or by a fork that finds none ready. On failure nothing is left."""
    from ..runtime import cgroup
    from ..runtime.state import Meta, WorkspaceDir, proc_start_time
    from . import engine

    d = WorkspaceDir.create()
    cg = None
    try:
        cg = cgroup.backend().create(f"ws-{d.id}", **core.config["limits"])
        d.write_meta(Meta(id=d.id, owner_pid=os.getpid(), owner_start=proc_start_time(os.getpid()) or 0,
                          cgroup=cg.name, rootfs="slot", lowers=[str(p) for p in core.lowers],
                          parent=core.id))
        return Slot(d, cg, engine.overlay_fd(core.lowers, d.upper, d.work))
    except BaseException:
        if cg is not None:
            cg.destroy()
        d.remove()
        raise


def enabled() -> bool:
    return os.environ.get("BUNSHIN_FORK_SLOTS", "1") != "0"


class Maker:
    """One daemon thread making slots for the templates that asked, one at a time."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._want: dict[int, tuple["TemplateCore", int]] = {}
        self._thread: threading.Thread | None = None

    def request(self, core: "TemplateCore", n: int) -> None:
        """Have ``min(n, MAX)`` slots ready for ``core``'s next fork call."""
        with self._cv:
            self._want[id(core)] = (core, min(n, MAX))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="bunshin-slots", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _next(self) -> "TemplateCore":
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
                s = make(core)
            except BaseException as e:  # noqa: BLE001 - the fork makes its own instead
                log.warning("making a slot for template %s: %s", core.id, e)
                with self._cv:
                    self._want.pop(id(core), None)
                continue
            if not core.add_slot(s):
                s.destroy()


_maker = PerProcess(Maker)


def request(core: "TemplateCore", n: int) -> None:
    """Ask for slots for ``core`` (no-op when turned off)."""
    if not enabled():
        return
    _maker.get().request(core, n)
