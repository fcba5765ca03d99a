"""CRIU ≥ 4 integration: workspace states on disk, and the baseline every benchmark beats.

>>> tpl = ws.snapshot(); tpl.save("/data/state-42")        # doctest: +SKIP
>>> tpl2 = bunshin.Template.load("/data/state-42")         # frozen; tpl2.fork(8) shares memory
>>> w = bunshin.criu.restore_workspace("/data/state-42")   # one independent running clone

``dump.py`` writes images (``dump_workspace``, ``save``), ``restore.py`` reads them
(``restore_workspace``, ``load``), ``images.py`` is the directory layout and its checks,
``initfds.py`` what is done to the init around a dump, ``externals.py`` host files, and
``runner.py`` runs the CRIU binary found by :mod:`bunshin.criu_locate`.
"""

from __future__ import annotations

from .dump import dump_workspace, save
from .images import read_meta
from .restore import load, restore_workspace

__all__ = ["dump_workspace", "load", "read_meta", "restore_workspace", "save"]
