"""Images as Workspaces and Templates: ``restore_workspace`` (a running, independent Workspace:
the CRIU baseline), ``load`` (a frozen Template, forkable with the live-fork engine) and
``restore_many`` (n running clones of one image that share its memory copy-on-write)."""

from __future__ import annotations

import os

from ..runtime.template import Template
from ..runtime.workspace import Workspace
from . import images
from .layerstore import Source
from .restore import restore

__all__ = ["load", "restore_many", "restore_workspace"]


def restore_workspace(path: str | os.PathLike, *, ksm: bool = False,
                      layers: Source | list[Source] | None = None) -> Workspace:
    """A running Workspace restored from the images at ``path`` (see :func:`dump_workspace`);
    the arguments and errors are :func:`bunshin.criu.restore.restore`'s; rootfs layers this
    node lacks are fetched from ``layers`` first (:func:`bunshin.criu.images.read_meta`)."""
    if layers is not None:
        images.read_meta(path, layers=layers)
    return Workspace.from_body(*restore(path, ksm=ksm))


def load(path: str | os.PathLike, *, layers: Source | list[Source] | None = None) -> Template:
    """A frozen Template restored from images: restore once, then freeze it as a template
    (``ws.snapshot()``), so that ``tpl.fork(n)`` shares its memory among the children."""
    ws = restore_workspace(path, layers=layers)
    try:
        return ws.snapshot()
    finally:
        ws.close()


def restore_many(path: str | os.PathLike, n: int) -> list[Workspace]:
    """``n`` running Workspaces restored from the images at ``path`` whose memory is shared
    copy-on-write, as forks' is: CRIU restores the image once into a frozen template, the fork
    engine makes the ``n`` clones of it (docs/design.md, "A memory-sharing restore"), and the
    template is let go (its pages stay shared by the clones). Each clone is as
    :func:`restore_workspace`'s would be but for what a fork refuses (``ForkError``, before any
    clone runs); the errors are :func:`load`'s and ``tpl.fork``'s."""
    if n < 1:
        raise ValueError(f"restore_many: n must be at least 1, not {n}")
    tpl = load(path)
    try:
        return tpl.fork(n)
    finally:
        tpl.close()
