"""Waiting for one descriptor to turn readable.

poll(), not select(): a trainer holds thousands of descriptors, and select() cannot watch one
numbered 1024 or above (it raises ValueError).
"""

from __future__ import annotations

import select
import time


def readable(fd: int, timeout: float) -> bool:
    """True once ``fd`` is readable (or hung up), False when ``timeout`` seconds pass first.
    A signal handler's interruption does not shorten the wait."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return bool(p.poll(0))
        if p.poll(left * 1000):
            return True
