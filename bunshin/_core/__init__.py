"""The compiled core: syscalls and hot loops (Cython and C), and the workspace init binary.

Backends are chosen here, once: :func:`backend` (``bunshin._core.kmod``) says whether the kernel
module (/dev/bunshin) or user space serves fork parent links and memory accounting, and why;
``BUNSHIN_KMOD`` (``auto``, ``0``, ``1``) overrides the automatic choice.
"""

from __future__ import annotations

from pathlib import Path

from . import _syscalls
from .kmod import Backend, KmodUnavailable, backend

__all__ = ["Backend", "KmodUnavailable", "PROTO", "backend", "init_path"]

PROTO: dict[str, int] = _syscalls.PROTO


def init_path() -> Path:
    """Path of the bunshin-init binary installed next to the compiled modules."""
    p = Path(_syscalls.__file__).with_name("bunshin-init")
    if not p.exists():
        from ..errors import BunshinError

        raise BunshinError(f"bunshin-init is missing at {p}: reinstall bunshin (pip install .)")
    return p
