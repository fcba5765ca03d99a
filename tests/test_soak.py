"""Soak: fork/run/close cycles from several threads, with random closes, restores and
speculation commits and rollbacks; at the end nothing is left that was not there at the start
(descriptors, threads, processes, mounts, cgroups, loop devices, state directories) and the
trainer's RSS is within 10% of its start. A short run here; `BUNSHIN_SOAK=10000` runs that many
cycles (the issue's soak, minutes)."""

from __future__ import annotations

import gc
import os
import random
import threading
import time
from pathlib import Path

import pytest

import bunshin

CYCLES = int(os.environ.get("BUNSHIN_SOAK", "240"))
THREADS = 4
POOL = 12  # children kept alive at once, closed at random


def _counts() -> dict[str, int]:
    """This test session's: other programs on the machine may mount and loop-attach meanwhile."""
    from bunshin import config

    prefix, state = config.cgroup_prefix(), str(config.state_dir())
    loops = [b for b in Path("/sys/block").glob("loop*/loop/backing_file")]
    return {
        "descriptors": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "child processes": sum(1 for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) == os.getpid()),
        "mounts": sum(1 for ln in Path("/proc/self/mountinfo").read_text().splitlines()
                      if ln.split()[4].startswith(state)),
        "cgroups": sum(1 for m in Path("/sys/fs/cgroup").iterdir() for _ in (m / prefix).glob("*")
                       if (m / prefix).is_dir()),
        "loop devices": sum(1 for b in loops if _read(b).startswith(state)),
        "state dirs": len(list((config.state_dir() / "ws").glob("*"))) if (config.state_dir() / "ws").exists() else 0,
    }


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""


def _ppid(p: Path) -> int:
    try:
        st = (p / "stat").read_bytes()
        return int(st[st.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError):
        return -1


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))


def _cycle(rng: random.Random, tpl, pool: list, lock: threading.Lock, counts: dict) -> None:
    op = rng.choice(["fork", "fork", "restore", "commit", "rollback", "close"])
    if op == "fork":
        kids = tpl.fork(rng.choice([1, 2]))
        for k in kids:
            assert k.run("echo ok").stdout == b"ok\n"
        with lock:
            pool.extend(kids)
            extra = pool[POOL:]
            del pool[POOL:]
        for k in extra:
            k.close()
    elif op == "close":
        with lock:
            k = pool.pop(rng.randrange(len(pool))) if pool else None
        if k is not None:
            assert k.run("cat /mark").stdout == b"template\n"
            k.close()
    else:
        (w,) = tpl.fork(1)
        try:
            w.run("echo mine > /mark")
            if op == "restore":
                w.restore(tpl)
                assert w.run("cat /mark").stdout == b"template\n"
            else:
                with w.speculate() as spec:
                    spec.ws.run("echo tried > /mark")
                    if op == "rollback":
                        spec.rollback()
                want = b"tried\n" if op == "commit" else b"mine\n"
                assert w.run("cat /mark").stdout == want, op
        finally:
            w.close()
    with lock:
        counts[op] = counts.get(op, 0) + 1


def _ahead_of_one_fork(tpl, timeout: float = 15) -> None:
    """The template's parts made ahead for its next call (fork/slots.py: as many as the last
    call asked, with the children's inits cloned into them) brought to one call of one child, so
    that two counts compare what the cycles left, not what the last cycle's size asked for."""
    from bunshin.fork import earlyinit, slots

    for k in tpl.fork(1):
        k.close()
    if not slots.enabled():
        return
    core = tpl._core
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with core.lock:
            ready = [s for s in core.slots if s.early is not None or not earlyinit.enabled()]
            if len(ready) == len(core.slots) == 1:
                return
        time.sleep(0.02)


def _sandbox_pool_full(ws, timeout: float = 15) -> None:
    """A sandbox's namespace pool full: it refills itself a moment after each take
    (fork/nsmaker.py), so that two counts compare what the cycles left, not how far the last
    take's refill had got."""
    userns = ws._body.userns
    pool = userns.pool if userns is not None else None
    deadline = time.monotonic() + timeout
    while pool is not None and len(pool._ready) < pool.size and time.monotonic() < deadline:
        time.sleep(0.02)


def _settle(before: dict[str, int], timeout: float = 15) -> dict[str, tuple[int, int]]:
    """What is above its count at the start, once closes have had ``timeout`` s to finish."""
    deadline = time.monotonic() + timeout
    while True:
        now = _counts()
        over = {k: (before[k], now[k]) for k in before if now[k] > before[k]}
        if not over or time.monotonic() > deadline:
            return over
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_soak_leaves_nothing_behind(no_leaks):
    ws = bunshin.Workspace.create()
    tpl = None
    try:
        ws.run("echo template > /mark")
        sh = ws.shell()
        sh.run("cd /tmp; X=1")
        ws.spawn(["python3", "-c", "import time; b = bytearray(8 << 20); time.sleep(10**6)"])
        tpl = ws.snapshot()
        pool: list = []
        lock = threading.Lock()
        counts: dict[str, int] = {}
        rng = random.Random(21)
        for _ in range(12):  # warm up: pools, threads and caches made on first use
            _cycle(rng, tpl, pool, lock, counts)
        for k in pool:
            k.close()
        pool.clear()
        _ahead_of_one_fork(tpl)
        _sandbox_pool_full(ws)
        gc.collect()
        before, rss0 = _counts(), _rss()
        errors: list[BaseException] = []
        left = iter(range(CYCLES))

        def worker(seed: int) -> None:
            r = random.Random(seed)
            try:
                while True:
                    with lock:
                        i = next(left, None)
                    if i is None or errors:
                        return
                    _cycle(r, tpl, pool, lock, counts)
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for k in pool:
            k.close()
        assert not errors, errors[0]
        assert sum(counts.values()) >= CYCLES and all(counts.get(op) for op in
                                                      ("fork", "restore", "commit", "rollback", "close"))
        _ahead_of_one_fork(tpl)
        _sandbox_pool_full(ws)
        gc.collect()
        over = _settle(before)
        assert not over, f"more than at the start (start, end): {over}"
        assert _rss() <= 1.1 * rss0, f"RSS {_rss()} kB at the end, {rss0} kB at the start"
    finally:
        if tpl is not None:
            tpl.close()
        ws.close()
