"""One object per trainer process, made on first use, for the fork engine's background
helpers (the namespace pool, the slot maker). A process forked from the trainer starts without
its parent's: the helper's thread did not survive the fork, and its lock may be held."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class PerProcess(Generic[T]):
    """``get()`` returns the process's object, made by ``make()`` on first use; a ``make()``
    that returns None (turned off) is asked again next time."""

    def __init__(self, make: Callable[[], T | None]) -> None:
        self._make = make
        self._obj: T | None = None
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._obj, self._lock = None, threading.Lock()

    def get(self) -> T | None:
        with self._lock:
            if self._obj is None:
                self._obj = self._make()
            return self._obj
