"""The compiled core: syscalls and hot loops (Cython and C), and the workspace init binary.

Backends are chosen here, once. ``BUNSHIN_BACKEND`` overrides the automatic choice of the
fork engine (``ptrace`` for the user-space engine, ``kmod`` for /dev/bunshin).
"""

from __future__ import annotations

from pathlib import Path

from . import _syscalls

__all__ = ["init_path", "PROTO"]

PROTO: dict[str, int] = _syscalls.PROTO


def init_path() -> Path:
    """Path of the bunshin-init binary installed next to the compiled modules."""
    p = Path(_syscalls.__file__).with_name("bunshin-init")
    if not p.exists():
        from ..errors import BunshinError

        raise BunshinError(f"bunshin-init is missing at {p}: reinstall bunshin (pip install .)")
    return p
