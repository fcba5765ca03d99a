"""Images as Workspaces and Templates: ``restore_workspace`` (a running, independent Workspace:
the CRIU baseline) and ``load`` (a frozen Template, forkable with the live-fork engine)."""

from __future__ import annotations

import os

from ..runtime.template import Template
from ..runtime.workspace import Workspace
from . import images
from .layerstore import Source
from .restore import restore

__all__ = ["load", "restore_workspace"]


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
