"""Templates: a workspace frozen at one moment, forkable many times (the handle; the frozen
processes and the fork engine are bunshin/fork/'s, see bunshin/fork/template.py)."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import criu
from ..errors import WorkspaceClosed
from ..fork import slots
from ..fork.template import TemplateCore, check_n
from . import aio

if TYPE_CHECKING:
    from ..criu.layerstore import Source
    from .workspace import Workspace

__all__ = ["Template"]

_live: weakref.WeakSet[Template] = weakref.WeakSet()


def close_all() -> None:
    """Close every template handle still open (a trainer that exits without closing them)."""
    for tpl in list(_live):
        try:
            tpl.close()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


class Template:
    """A frozen workspace state. ``fork(n)`` makes live copies; ``close()`` when done.

    Children outlive the handle: the frozen state is kept until the last child closes.
    """

    def __init__(self, core: TemplateCore) -> None:
        self._core = core
        self._closed = False
        _live.add(self)

    @property
    def id(self) -> str:
        return self._core.id

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def core(self) -> TemplateCore:
        """The frozen processes behind this handle (bunshin/fork/template.py)."""
        return self._core

    def fork(self, n: int = 1, on_fork: Callable[[Workspace], None] | None = None) -> list[Workspace]:
        """``n`` live workspaces in the template's state (memory shared copy-on-write).
        ``on_fork(child)`` runs once per child before its processes resume, in the fork engine's
        thread (keeper.py): it must not wait for a fork made by another thread (forks run
        there one at a time; calling fork() from on_fork is fine for another template)."""
        if self._closed:
            raise WorkspaceClosed(f"template {self.id} is closed")
        check_n(n)
        kids = self._core.fork(n, on_fork, keep=True)
        slots.request(self._core, n)  # the next call's host-side parts, made meanwhile
        return kids

    async def afork(self, n: int = 1) -> list[Workspace]:
        """:meth:`fork` for asyncio (the event loop runs on while the fork thread forks)."""
        check_n(n)
        return await aio.in_thread(lambda: self.fork(n))

    async def aclose(self) -> None:
        """:meth:`close` for asyncio."""
        await aio.in_thread(self.close)

    def save(self, path: str | os.PathLike) -> None:
        """Write this frozen state to ``path`` (a new or empty directory) with CRIU; see
        :mod:`bunshin.criu`. The template is left as it was."""
        if self._closed:
            raise WorkspaceClosed(f"template {self.id} is closed")
        criu.save(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike, *, layers: Source | list[Source] | None = None) -> Template:
        """A frozen template restored from images written by :meth:`save` (or
        ``bunshin.criu.dump_workspace``); fork it as any other. Rootfs layers this node lacks
        are fetched from ``layers`` (a shared store directory, a callable ``digest -> chunks``
        or a list of them; see :mod:`bunshin.criu.layerstore`) or ``BUNSHIN_LAYER_STORE``."""
        return criu.load(path, layers=layers)

    def host_pids(self) -> list[int]:
        """Host pids of the template's frozen processes (for accounting): its group's members,
        which need not wait for a snapshot's plan, read ahead of its first fork."""
        return self._core.body.cgroup.pids()

    def close(self) -> None:
        """Drop this handle; the frozen processes go when no child needs them."""
        if not self._closed:
            self._closed = True
            self._core.let_go()  # no more forks: the engine's thread stops holding them
            self._core.close_slots()
            self._core.release()

    def __enter__(self) -> Template:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Template {self.id}{' closed' if self._closed else ''}>"
