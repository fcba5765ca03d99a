"""The fork engine's thread: every fork's ptrace work runs here, and templates stay seized.

ptrace binds a tracee to the thread that seized it, so a template's processes used to be
seized, stopped, cured and detached again on every fork, from whichever thread called
(~0.15 ms for an init and a shell here). One daemon thread per trainer process now makes every
fork: the caller hands it the work and waits. After a ``tpl.fork()`` the template's processes
stay seized by it, ptrace-stopped *and* frozen as before (a trainer that dies leaves them
frozen, not running); a later fork thaws them only if it must run one of them, and refreezes
them as idle work (a trainer dying in between leaves them running, as one dying mid-fork
would). They are let go when the Template handle closes, when a fork fails, and at exit. Work
that no caller waits for (preparing the next fork of a held template) runs when no fork is
asked for.
"""

from __future__ import annotations

import _thread
import atexit
import collections
import logging
import queue
import threading
import time
import weakref
from typing import Any, TypeVar
from collections.abc import Callable

from .perprocess import PerProcess

log = logging.getLogger("bunshin.fork")

R = TypeVar("R")


IDLE_AFTER_CALL_S = 0.0003


class _Call:
    """One call waited for: ``done`` is held until the engine has run it. A bare lock, not a
    Future: the caller's wait and wake-up are one futex each way (a Future's Condition made
    a hand-off ~50 us slower here, of ~0.1 ms)."""

    __slots__ = ("fn", "args", "done", "result", "error", "finished", "abandon")

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        # dropped (None) once run, with the references they hold
        self.fn: Callable[..., Any] | None = fn
        self.args: tuple | None = args
        self.done = _thread.allocate_lock()
        self.done.acquire()
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished = False
        self.abandon: Callable[[Any], None] | None = None

    def wait(self) -> None:
        self.done.acquire()


_WAKE = object()  # in the queue after idle work is posted: the engine looks at its idle list


class ForkThread:
    """One thread running what :meth:`run` and :meth:`post` hand it: calls waited for first,
    in order, then idle work."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._idle: collections.deque = collections.deque()
        self._guard = threading.Lock()  # a call finishing vs. its caller giving up on it
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
        call = _Call(fn, args)
        self._calls.put(call)
        try:
            call.wait()  # as long as the call: every wait of a fork on the kernel is bounded
        except BaseException:
            # not the call's own failure: this caller stopped waiting (at once if it is done)
            if abandon is not None:
                with self._guard:
                    finished = call.finished
                    if not finished:
                        call.abandon = abandon
                if finished and call.error is None:
                    _dispose(call.result, abandon)
            raise
        if call.error is not None:
            raise call.error
        return call.result

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` some time later, when no call is waiting; its errors are logged."""
        self._idle.append((fn, args))
        self._calls.put(_WAKE)

    def _loop(self) -> None:
        after_call = False
        while True:
            try:
                item = self._calls.get() if not self._idle else self._calls.get_nowait()
            except queue.Empty:
                item = None
            if item is _WAKE:
                continue
            if item is None:
                if after_call:
                    # the caller just woken needs the GIL to take its result: a short sleep
                    # lets it have it before idle work that holds it (a sleep(0) takes it
                    # straight back before the caller's thread is even scheduled)
                    time.sleep(IDLE_AFTER_CALL_S)
                after_call = False
                fn, args = self._idle.popleft()
                try:
                    fn(*args)
                except BaseException as e:  # noqa: BLE001 - idle work: the next fork does it
                    log.warning("fork engine, idle work %s: %s", getattr(fn, "__name__", fn), e)
                continue
            after_call = True
            self._finish(item)

    def _finish(self, call: _Call) -> None:
        try:
            assert call.fn is not None and call.args is not None  # a call is run once
            call.result = call.fn(*call.args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            call.error = e
        call.fn = call.args = None
        with self._guard:
            call.finished = True
            abandon = call.abandon
        call.done.release()
        if abandon is not None and call.error is None:
            _dispose(call.result, abandon)


def _dispose(result: Any, abandon: Callable[[Any], None]) -> None:
    try:
        abandon(result)
    except Exception as e:  # noqa: BLE001 - nobody left to tell but the log
        log.warning("disposing of an abandoned fork's result: %s", e)


_fork_thread = PerProcess(ForkThread)
_held: weakref.WeakSet[Any] = weakref.WeakSet()  # cores whose processes the engine holds


def fork_thread() -> ForkThread:
    e = _fork_thread.get()
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
