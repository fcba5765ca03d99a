"""Cache directories built once, atomically, safely against concurrent builders.

A builder fills a private temporary directory next to the final one and renames it into
place under a per-entry ``flock``. Whoever takes the lock second finds the entry done. Only
the lock holder creates temporaries, so any temporary found under the lock was left by a
killed builder and is removed. Lock files are unlinked on release; a waiter that locked an
unlinked file notices (inode differs from the path) and locks again.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["entry_lock", "install", "stale_temporaries"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def entry_lock(final: Path) -> Iterator[None]:
    """Hold the exclusive lock that guards building ``final``."""
    lock = final.parent / f".{final.name}.lock"
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(lock).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            break
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
        os.close(fd)


def stale_temporaries(final: Path) -> list[Path]:
    """Temporaries of ``final`` on disk (only meaningful under its lock, or after use)."""
    parent = final.parent
    if not parent.is_dir():
        return []
    return sorted(
        parent / name
        for name in os.listdir(parent)
        if name.startswith((f".tmp-{final.name}-", f".old-{final.name}-"))
    )


def install(final: Path, build: Callable[[Path], None], *, replace: bool = False) -> bool:
    """Make ``final`` exist, running ``build(tmpdir)`` to fill it if needed.

    Returns True if this call built it, False if it was already there. With ``replace``,
    an existing entry is rebuilt and swapped in. On any failure nothing is left behind.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    with entry_lock(final):
        if final.is_dir() and not replace:
            return False
        for stale in stale_temporaries(final):
            log.info("rootfs store: removing %s left by an interrupted build", stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        old: Path | None = None
        try:
            os.chmod(tmp, 0o755)
            build(tmp)
            if final.exists():
                old = Path(tempfile.mkdtemp(prefix=f".old-{final.name}-", dir=final.parent))
                os.rename(final, old / "entry")
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if old is not None and not final.exists():
                os.rename(old / "entry", final)
            raise
        finally:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        return True
