"""Scoring a finished rollout: run its task's :class:`~bunshin.rl.types.Verifier` in the
workspace it ended in and turn what the check says into a :class:`~bunshin.rl.types.Verdict`.

Every failure of the check itself (a crash, a timeout, an unusable return value, a workspace
that died) becomes a Verdict with ``error`` set and the verifier's ``failure_reward``: a
trainer always gets one verdict per rollout, never an exception.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
from typing import TYPE_CHECKING, Any

from .types import Trajectory, Verdict, Verifier

if TYPE_CHECKING:
    from ..runtime.workspace import Workspace

__all__ = ["OUTPUT_LIMIT", "averify", "verdict_of_command", "verdict_of_value", "verify"]

OUTPUT_LIMIT = 8 << 10
"""Characters of a check's output kept in its verdict (the tail: where test runners sum up)."""


def _tail(text: str) -> str:
    return text if len(text) <= OUTPUT_LIMIT else text[-OUTPUT_LIMIT:]


def _number(text: str) -> float | None:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        v = float(lines[-1])
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def verdict_of_command(stdout: str, output: str, exit_code: int, seconds: float) -> Verdict:
    """A command check's verdict: passed on exit 0; reward the number on stdout's last line, else
    1.0 passed / 0.0 not."""
    passed = exit_code == 0
    n = _number(stdout)
    return Verdict(reward=n if n is not None else float(passed), passed=passed, output=_tail(output),
                   seconds=seconds)


def verdict_of_value(v: Any, seconds: float, failure_reward: float) -> Verdict:
    """A Python check's return value as a verdict (see :class:`~bunshin.rl.types.Verifier`)."""
    if isinstance(v, Verdict):
        return Verdict(float(v.reward), bool(v.passed), _tail(v.output), seconds, v.error)
    if isinstance(v, bool):
        return Verdict(float(v), v, seconds=seconds)
    if isinstance(v, (int, float)) and math.isfinite(v):
        return Verdict(float(v), v > 0, seconds=seconds)
    if (isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], (int, float)) and not isinstance(v[0], bool)
            and math.isfinite(v[0]) and isinstance(v[1], bool)):
        return Verdict(float(v[0]), v[1], seconds=seconds)
    return Verdict(failure_reward, False, seconds=seconds,
                   error=f"the verifier returned {v!r:.200}; expected a Verdict, a bool, a finite number "
                         "or a (reward, passed) pair")


async def _in_thread(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a daemon thread of its own: one that overstays its timeout is abandoned
    without holding up a pool's shutdown."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def work() -> None:
        try:
            value, ok = fn(*args), True
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            value, ok = e, False
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:
            pass  # the loop is gone: nobody waits any more

    threading.Thread(target=work, name="bunshin-verifier", daemon=True).start()
    return await fut


async def _check(verifier: Verifier, ws: Workspace, traj: Trajectory | None, workdir: str | None) -> Verdict:
    t = time.monotonic()
    check = verifier.check
    if isinstance(check, str):
        r = await ws.arun(check, cwd=workdir, timeout=verifier.timeout)
        seconds = time.monotonic() - t
        if r.timed_out:
            return Verdict(verifier.failure_reward, False, _tail(r.output), seconds,
                           error=f"the verifier command timed out after {verifier.timeout:g} s")
        return verdict_of_command(r.stdout.decode("utf-8", "replace"), r.output, r.exit_code, seconds)
    if inspect.iscoroutinefunction(check):
        value = await asyncio.wait_for(check(ws, traj), verifier.timeout)
    else:
        value = await asyncio.wait_for(_in_thread(check, ws, traj), verifier.timeout)
        if inspect.isawaitable(value):
            value = await asyncio.wait_for(value, max(0.0, verifier.timeout - (time.monotonic() - t)))
    return verdict_of_value(value, time.monotonic() - t, verifier.failure_reward)


async def averify(verifier: Verifier, ws: Workspace | None, traj: Trajectory | None,
                  workdir: str | None = None) -> Verdict:
    """``verifier``'s verdict on rollout ``traj`` in workspace ``ws`` (None: the rollout never got
    one, which is a failed verdict). With ``verifier.on_fork`` the check runs on a fork of ``ws``,
    closed afterwards. Never raises (but for cancellation)."""
    t = time.monotonic()
    if ws is None:
        return Verdict(verifier.failure_reward, False, error="the rollout had no workspace to verify")
    target = ws
    try:
        if verifier.on_fork:
            (target,) = await ws.afork(1)
        try:
            return await _check(verifier, target, traj, workdir)
        finally:
            if target is not ws:
                await target.aclose()
    except TimeoutError:
        return Verdict(verifier.failure_reward, False, seconds=time.monotonic() - t,
                       error=f"the verifier timed out after {verifier.timeout:g} s")
    except Exception as e:  # noqa: BLE001 - a crashing check is a recorded failure, not a lost group
        return Verdict(verifier.failure_reward, False, seconds=time.monotonic() - t,
                       error=f"{type(e).__name__}: {e}")


def verify(verifier: Verifier, ws: Workspace, traj: Trajectory | None = None,
           workdir: str | None = None) -> Verdict:
    """:func:`averify` for synchronous code (an environment's step that scores the workspace
    mid-episode: use ``on_fork`` so the episode goes on untouched). Called on a thread that runs
    an event loop (a framework calling a sync ``step`` from its loop), the check runs on a
    thread and loop of its own: ``asyncio.run`` cannot nest."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(averify(verifier, ws, traj, workdir))
    box: list[Verdict] = []
    th = threading.Thread(target=lambda: box.append(asyncio.run(averify(verifier, ws, traj, workdir))),
                          name="bunshin-verify", daemon=True)
    th.start()
    th.join()  # bounded: averify's check is bounded by verifier.timeout and returns, never raises
    return box[0] if box else Verdict(verifier.failure_reward, False, error="the verifier's thread died")
