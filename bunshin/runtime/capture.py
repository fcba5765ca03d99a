"""Bounded capture of a tool call's output: never an unbounded buffer."""

from __future__ import annotations

import os
import selectors
import time
from collections.abc import Callable

DEFAULT_MAX_OUTPUT = 1 << 20  # per stream; agents rarely benefit from more


class Capture:
    """Keeps the first ``cap`` bytes written to it and counts the rest."""

    __slots__ = ("buf", "cap", "dropped")

    def __init__(self, cap: int) -> None:
        self.buf = bytearray()
        self.cap = cap
        self.dropped = 0

    def feed(self, data: bytes) -> None:
        room = self.cap - len(self.buf)
        if room >= len(data):
            self.buf += data
        else:
            if room > 0:
                self.buf += data[:room]
            self.dropped += len(data) - max(room, 0)


def pump(fds: dict[int, Capture], deadline: float, exited: Callable[[], bool],
         grace: float = 0.1) -> bool:
    """Read ``fds`` into their captures until all reach EOF, or ``deadline``, or ``grace``
    seconds after ``exited()`` turns true (background children may hold a pipe open forever).

    Closes every fd. Returns True when it stopped because of the deadline.
    """
    sel = selectors.DefaultSelector()
    for fd in fds:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    stop_at: float | None = None
    timed_out = False
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if stop_at is None and exited():
                stop_at = now + grace
            if stop_at is not None and now >= stop_at:
                break
            wait = min(deadline, stop_at if stop_at is not None else now + 0.05) - now
            for key, _ in sel.select(max(wait, 0)):
                try:
                    data = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data:
                    fds[key.fd].feed(data)
                else:
                    sel.unregister(key.fd)
    finally:
        sel.close()
        for fd in fds:
            os.close(fd)
    return timed_out
