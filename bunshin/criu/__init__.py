"""CRIU ≥ 4 integration: workspace states on disk, and the baseline every benchmark beats.

>>> tpl = ws.snapshot(); tpl.save("/data/state-42")        # doctest: +SKIP
>>> tpl2 = bunshin.Template.load("/data/state-42")         # frozen; tpl2.fork(8) shares memory
>>> w = bunshin.criu.restore_workspace("/data/state-42")   # one independent running clone
>>> ws8 = bunshin.criu.restore_many("/data/state-42", 8)   # 8 running clones sharing memory

``dump.py`` writes images (``dump``: a body; ``dump_workspace``, ``save``), ``restore.py`` reads
them back into a body (``restore``), ``workspaces.py`` makes Workspaces and Templates of them
(``restore_workspace``, ``load``, ``restore_many``), ``images.py`` is the directory layout and
its checks, ``bases.py`` and ``layerstore.py`` the rootfs layers an image stands on (by content
digest, fetched when missing), ``transfer.py`` images as byte streams between nodes,
``initfds.py`` what is done to the init around a dump, ``externals.py`` host files, ``plugin.py``
Bunshin's CRIU plugin (the control socket and host files), ``handover.py`` how those reach
CRIU's options, and ``runner.py`` sends CRIU (found by :mod:`bunshin.criu_locate`; Bunshin's
patched build is :mod:`bunshin.criu_build`) its requests through pycriu's RPC
(:mod:`bunshin.criu_rpc`).
"""

from __future__ import annotations

import importlib
from typing import Any

from .dump import dump, dump_workspace, save
from .images import read_meta
from .restore import restore
from .transfer import image_layers, layer_chunks, missing_layers, pack, receive_layer, unpack

__all__ = ["dump", "dump_workspace", "image_layers", "layer_chunks", "load", "missing_layers", "pack",
           "read_meta", "receive_layer", "restore", "restore_many", "restore_workspace", "save", "unpack"]


def __getattr__(name: str) -> Any:
    # workspaces.py stands on bunshin.runtime.workspace, which stands on this package: it is
    # imported once asked for
    if name in ("load", "restore_many", "restore_workspace"):
        return getattr(importlib.import_module(".workspaces", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
