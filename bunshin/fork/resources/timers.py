"""Timers: fork(2) drops them, so each clone gets its template's back with the time they had
left — setitimer() timers, and POSIX timers (timer_create) with their ids, clocks, signals and
notification targets, read from /proc/PID/timers."""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from types import SimpleNamespace

from ...compel import Tracee
from ...errors import ForkError
from . import signals

_ITIMERS = (0, 1, 2)  # ITIMER_REAL, ITIMER_VIRTUAL, ITIMER_PROF
_ITV = struct.Struct("4q")  # it_interval, it_value (timevals)
_ITS = struct.Struct("4q")  # it_interval, it_value (timespecs)
_NOTIFY = {"signal": 0, "none": 1, "thread": 2}  # SIGEV_SIGNAL, SIGEV_NONE, SIGEV_THREAD
_SIGEV_THREAD_ID = 4  # with SIGEV_SIGNAL: to one thread ("signal/tid.N" in /proc/PID/timers)
_TIMER_ABSTIME = 1
# clocks whose absolute time the fork thread reads as the clone's timer does (not CPU clocks)
_ABS_CLOCKS = (0, 1, 7, 8, 9, 11)  # REALTIME, MONOTONIC, BOOTTIME, their _ALARM, TAI
_MAX_GAP = 4096  # ids are allocated in order from 0; holes are filled with throwaway timers


@dataclass
class PosixTimer:
    id: int
    signo: int
    value: int
    notify: int
    target: int  # tid for SIGEV_THREAD_ID, as the workspace sees it
    clock: int


def _parse(text: str, vtids: dict[int, int]) -> list[PosixTimer]:
    """/proc/PID/timers, read on the host: a thread is named by its host tid (``vtids`` maps
    those of the process to the workspace's)."""
    out: list[PosixTimer] = []
    cur: dict[str, str] = {}
    for line in text.splitlines() + ["ID: end"]:
        key, _, val = line.partition(":")
        val = val.strip()
        if key == "ID" and cur:
            sig, value = cur["signal"].split("/")
            how, _, who = cur["notify"].partition("/")
            kind, _, tid = who.partition(".")
            notify, target = _NOTIFY[how], 0
            if kind == "tid":
                notify, target = notify | _SIGEV_THREAD_ID, vtids[int(tid)]
            out.append(PosixTimer(int(cur["ID"]), int(sig), int(value, 16), notify, target,
                                  int(cur["ClockID"])))
            cur = {}
        cur[key] = val
    return sorted(out, key=lambda t: t.id)


def plan_proc(proc) -> None:
    # Whether a fork found no setitimer() timer running: the process is frozen for good, so none
    # can start again and later forks need not look (an armed one keeps counting down, though,
    # and is read by every fork).
    proc.itimers_idle = False
    proc.itimers = None
    proc.timers_refired = set()  # of this fork: those whose pending signal they queue again
    try:
        with open(f"/proc/{proc.hostpid}/timers") as f:
            proc.posix_timers = _parse(f.read(), proc.thread_vtids)
    except FileNotFoundError:
        proc.posix_timers = []
    if proc.posix_timers and proc.posix_timers[-1].id > _MAX_GAP:
        raise ForkError(f"process {proc.vpid} ({proc.name}) has a POSIX timer with id "
                        f"{proc.posix_timers[-1].id}; ids above {_MAX_GAP} cannot be recreated",
                        pid=proc.hostpid, step="plan")


def ask(ctx, proc, q) -> None:
    """The setitimer() timers, read in the template (getitimer) at every fork until one
    finds none running: what is left of an armed one changes."""
    proc.itimers = None  # of this fork: (the getitimer results, their itimervals)
    if proc.itimers_idle:
        return

    def answer(got: list[int], raw: bytes) -> None:
        proc.itimers = (got, raw)

    q.ask(len(_ITIMERS) * _ITV.size,
          lambda addr, first: [(36, (which, addr + i * _ITV.size), Tracee.BATCH_OK_ERR)
                               for i, which in enumerate(_ITIMERS)], answer)


def fixup_proc(ctx, proc, r) -> None:
    if proc.itimers is not None:
        got, raw = proc.itimers
        proc.itimers = None
        armed = False
        for i, which in enumerate(_ITIMERS):  # one whose getitimer failed is left unset
            if i < len(got) and got[i] == 0 and any(_ITV.unpack_from(raw, i * _ITV.size)):
                armed = True
                r.call("setitimer", which, r.put(raw[i * _ITV.size:(i + 1) * _ITV.size]), 0)
        proc.itimers_idle = not armed and len(got) == len(_ITIMERS) and all(g == 0 for g in got)
    if proc.posix_timers:
        src = ctx.shared["tracees"][proc.hostpid]
        with src.scratch() as addr:
            _posix_timers(proc, r, src, addr)


def _posix_timers(proc, r, src, scratch: int) -> None:
    """POSIX timers, read in the template (``src``, ``scratch``: _ITS.size bytes there)."""
    throwaway = []
    fired = signals.timers_pending(proc) if proc.posix_timers else set()
    proc.timers_refired = set()
    for t in getattr(proc, "posix_timers", ()):
        if src.syscall(224, t.id, scratch) != 0:  # timer_gettime, in the template
            raise ForkError(f"process {proc.vpid}: cannot read POSIX timer {t.id}", pid=proc.hostpid)
        its, flags = src.read(scratch, _ITS.size), 0
        if t.id in fired and t.clock in _ABS_CLOCKS:
            its, flags = _fire_now(its, t.clock), _TIMER_ABSTIME
            proc.timers_refired.add(t.id)
        sigevent = struct.pack("qiii", t.value, t.signo, t.notify, t.target).ljust(64, b"\0")
        ev, idp = r.put(sigevent, 0), r.put(bytes(4), 64)
        while True:
            r.call("timer_create", t.clock, ev, idp)
            got = struct.unpack("i", r.t.read(idp, 4))[0]
            if got == t.id:
                break
            if got > t.id:
                raise ForkError(f"process {proc.vpid}: POSIX timer {t.id} came back as {got}")
            throwaway.append(got)
        r.call("timer_settime", t.id, flags, r.put(its, 128), 0)
    for tid in throwaway:
        r.call("timer_delete", tid)


def _fire_now(its: bytes, clock: int) -> bytes:
    """A setting (absolute) under which a timer whose signal is pending in the template fires
    at once in the clone, queueing that signal as its own (a plain copy would not be the
    timer's: a second expiry would queue another, where the template's counts an overrun, and
    re-arming the timer would not drop it), and then keeps the template's period and phase."""
    isec, insec, vsec, vnsec = _ITS.unpack(its)
    interval, left = isec * 10**9 + insec, vsec * 10**9 + vnsec
    at = time.clock_gettime_ns(clock) + left - interval if interval else 1
    return _ITS.pack(isec, insec, at // 10**9, at % 10**9)


OPS = SimpleNamespace(kind="timers", plan_proc=plan_proc, ask=ask, fixup_proc=fixup_proc)
