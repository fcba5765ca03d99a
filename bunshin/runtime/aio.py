"""The asyncio side of tool calls: a call's output read by the event loop (``add_reader``),
its start and its exit answered through the control channel's futures, so a rollout loop keeps
thousands of calls in flight on one thread. What blocks by nature (forks, which run one at a
time in the fork thread anyway; closes; a shell session's terminal) runs in a small pool of
threads of its own, so that it never holds up the event loop."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ..fork.perprocess import PerProcess
from .capture import Capture
from .channel import Channel

T = TypeVar("T")
log = logging.getLogger("bunshin")

_pool = PerProcess(lambda: ThreadPoolExecutor(max_workers=32, thread_name_prefix="bunshin-aio"))
_reaping: set[asyncio.Task] = set()  # exits still to be collected after a cancelled call


async def in_thread(fn: Callable[[], T]) -> T:
    """``fn()`` in Bunshin's own threads (not the loop's default executor, which the trainer
    may size for its own work)."""
    return await asyncio.get_running_loop().run_in_executor(_pool.get(), fn)


def iterate_in_thread(make: Callable[[], AsyncIterator[T]], name: str,
                      stop_wait: float = 10.0) -> Iterator[T]:
    """The items of the async iterator ``make()`` for a caller without an event loop: it runs
    on a loop of a thread of its own, so the next items are made while the caller works on one.
    Its error is raised here. Leaving early cancels it; its thread is waited for at most
    ``stop_wait`` seconds (a daemon: it ends with its cancelled work)."""
    items: queue.Queue[tuple[str, Any]] = queue.Queue()
    running: dict[str, Any] = {}
    started = threading.Event()

    async def pump() -> None:
        running["loop"], running["task"] = asyncio.get_running_loop(), asyncio.current_task()
        started.set()
        async for item in make():
            items.put(("item", item))

    def main() -> None:
        try:
            asyncio.run(pump())
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            items.put(("error", e))
        else:
            items.put(("end", None))
        finally:
            started.set()

    th = threading.Thread(target=main, name=name, daemon=True)
    th.start()
    try:
        while True:
            kind, value = items.get()
            if kind == "item":
                yield value
            elif kind == "error":
                raise value
            else:
                return
    finally:
        if th.is_alive():
            started.wait(stop_wait)
            try:
                running["loop"].call_soon_threadsafe(running["task"].cancel)
            except (KeyError, RuntimeError):
                pass  # it ended meanwhile
            th.join(stop_wait)
            if th.is_alive():
                log.warning("%s: still stopping after %.0f s; left to end on its own", name, stop_wait)


async def collect(chan: Channel, pid: int, fds: dict[int, Capture], timeout: float | None,
                  grace: float = 0.1) -> tuple[int, bool]:
    """Read ``fds`` into their captures while ``pid`` runs, then for ``grace`` seconds at most
    (a background child may hold a pipe open for ever). Returns (raw wait status, timed out).
    On timeout, or when the caller is cancelled, the call's process group is killed; the
    descriptors are closed whatever happens."""
    loop = asyncio.get_running_loop()
    ended = {fd: asyncio.Event() for fd in fds}

    def readable(fd: int) -> None:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            fds[fd].feed(data)
        else:
            loop.remove_reader(fd)
            ended[fd].set()

    for fd in fds:
        os.set_blocking(fd, False)
        loop.add_reader(fd, readable, fd)
    start = time.monotonic()
    try:
        timed_out = False
        try:
            status = await asyncio.wait_for(chan.await_exit(pid), timeout)
        except TimeoutError:
            timed_out = True
            chan.kill(pid, signal.SIGKILL, "pgrp")
            status = await asyncio.wait_for(chan.await_exit(pid), 10)
        except asyncio.CancelledError:
            _kill_and_reap(chan, pid)
            raise
        left = grace if timeout is None else min(grace, max(timeout - (time.monotonic() - start), 0))
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in ended.values())), left)
        except TimeoutError:
            pass
        return status, timed_out
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)


def _kill_and_reap(chan: Channel, pid: int) -> None:
    """A cancelled call: its process group is killed at once and its exit collected later (the
    channel would keep it otherwise); the workspace stays usable."""
    try:
        chan.kill(pid, signal.SIGKILL, "pgrp")
    except Exception:  # noqa: BLE001 - a dead workspace has nothing left to kill
        return
    task = asyncio.get_running_loop().create_task(chan.aend(pid))
    _reaping.add(task)
    task.add_done_callback(_reaping.discard)
