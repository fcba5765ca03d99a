"""The fork engine's thread: every fork's ptrace work runs here, and templates stay seized.

ptrace binds a tracee to the thread that seized it, so a template's processes used to be
seized, stopped, cured and detached again on every fork, from whichever thread called
(~0.15 ms for an init and a shell here). One daemon thread per trainer process now makes every
fork: the caller hands it the work and waits. After a ``tpl.fork()`` the template's processes
stay seized by it, ptrace-stopped *and* frozen as before (a trainer that dies leaves them
frozen, not running); a later fork thaws them only if it must run one of them, and refreezes
them as idle work (a trainer dying in between leaves them running, as one dying mid-fork
would). They are let go when the Template handle closes, when a fork fails, and at exit. Work that no caller waits for (preparing the
next fork of a held template) runs when no fork is asked for.
"""

from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

from .perprocess import PerProcess

log = logging.getLogger("bunshin.fork")

R = TypeVar("R")


IDLE_AFTER_CALL_S = 0.0003


class Engine:
    """One thread running what :meth:`run` and :meth:`post` hand it: calls waited for first,
    in order, then idle work."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._urgent: collections.deque = collections.deque()
        self._idle: collections.deque = collections.deque()
        self._thread = threading.Thread(target=self._loop, name="bunshin-fork", daemon=True)
        self._thread.start()

    def here(self) -> bool:
        return threading.current_thread() is self._thread

    def run(self, fn: Callable[..., R], *args: Any,
            abandon: Callable[[R], None] | None = None) -> R:
        """``fn(*args)`` in the engine's thread (at once when called from it); its result or
        exception. A caller interrupted while waiting (KeyboardInterrupt) leaves the call to
        finish: ``abandon(result)`` then disposes of what it made."""
        if self.here():
            return fn(*args)
        fut: Future = Future()
        with self._cv:
            self._urgent.append((fn, args, fut))
            self._cv.notify()
        try:
            return fut.result()
        except BaseException as e:
            # not the call's own failure: this caller stopped waiting (at once if it is done)
            if abandon is not None and not (fut.done() and fut.exception() is e):
                fut.add_done_callback(lambda f: _dispose(f, abandon))
            raise

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` some time later, when no call is waiting; its errors are logged."""
        with self._cv:
            self._idle.append((fn, args, None))
            self._cv.notify()

    def _loop(self) -> None:
        after_call = False
        while True:
            with self._cv:
                while not self._urgent and not self._idle:
                    self._cv.wait()
                fn, args, fut = (self._urgent or self._idle).popleft()
            if fut is None:
                if after_call:
                    # the caller just woken needs the GIL to take its result: a short sleep
                    # lets it have it before idle work that holds it (a sleep(0) takes it
                    # straight back before the caller's thread is even scheduled)
                    time.sleep(IDLE_AFTER_CALL_S)
                after_call = False
                try:
                    fn(*args)
                except BaseException as e:  # noqa: BLE001 - idle work: the next fork does it
                    log.warning("fork engine, idle work %s: %s", getattr(fn, "__name__", fn), e)
                continue
            if not fut.set_running_or_notify_cancel():
                continue
            after_call = True
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)


def _dispose(fut: Future, abandon: Callable[[Any], None]) -> None:
    if fut.exception() is None:
        try:
            abandon(fut.result())
        except Exception as e:  # noqa: BLE001 - nobody left to tell but the log
            log.warning("disposing of an abandoned fork's result: %s", e)


_engine = PerProcess(Engine)
_held: "weakref.WeakSet[Any]" = weakref.WeakSet()  # cores whose processes the engine holds


def engine() -> Engine:
    e = _engine.get()
    assert e is not None
    return e


def holding(core: Any) -> None:
    """``core`` (with a ``let_go()``) holds seized processes: let go of them at exit."""
    _held.add(core)


def released(core: Any) -> None:
    _held.discard(core)


@atexit.register
def _let_all_go() -> None:
    for core in list(_held):
        try:
            core.let_go()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass
