"""Recreating a multi-threaded process's threads in its injected clone (Tracee.clone_threads).

Victims: tests/victims/workers.c (C: counters, a condvar waiter, a napper, a sigwaitinfo main
thread) and tests/victims/listers.py (CPython threads). Every check reads the clone's own
state: its memory (process_vm_readv), /proc, ptrace, what its threads do once resumed.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from test_compel import VICTIMS, Procs, status, wait_for

from bunshin.compel import SYS_getpid, Tracee
from bunshin.errors import ForkError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ptrace of other processes needs root")

NCOUNT = 16
# word offsets in workers.c's `st`
COUNTERS, TIDS = 0, 64
WAITER_TID, WOKE_TID, NAPPER_TID, NAPS, USR1, JOINED = range(128, 134)
NWORDS = 134


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    import shutil
    import subprocess

    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is needed to build the C victims")
    out = tmp_path_factory.mktemp("victims")
    for name in ("workers", "pidns_init"):
        subprocess.run([gcc, "-O2", "-pthread", "-o", out / name, VICTIMS / f"{name}.c"],
                       check=True)
    return out


@pytest.fixture
def procs():
    ps = Procs()
    yield ps
    ps.cleanup()


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)


def vm_read(pid: int, addr: int, n: int) -> bytes:
    buf = ctypes.create_string_buffer(n)
    local, remote = _Iovec(ctypes.addressof(buf), n), _Iovec(addr, n)
    got = _libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if got != n:
        raise OSError(ctypes.get_errno(), f"process_vm_readv {pid}")
    return buf.raw


def words(pid: int, base: int) -> list[int]:
    raw = vm_read(pid, base, 8 * NWORDS)
    return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, len(raw), 8)]


def tasks(pid: int) -> set[int]:
    return {int(t) for t in os.listdir(f"/proc/{pid}/task")}


def start_workers(procs, workers) -> tuple[int, int]:
    p, line = procs.start([workers / "workers", str(NCOUNT)])
    base = int(line.split()[2], 16)
    time.sleep(0.2)  # the napper is inside nanosleep, the waiter inside futex
    return p.pid, base


def check_kernel_state(t: Tracee, child: Tracee, pairs: list[tuple[int, int]]):
    """What the kernel holds per thread matches the source's, read back through ptrace/proc."""
    for old, new in pairs:
        s, c = t.thread_state(old), child.thread_state(new)
        assert c.rseq == s.rseq and s.rseq[0], (old, new)
        assert c.robust_list == s.robust_list and s.robust_list[0]
        assert c.sigmask == s.sigmask
        assert status(new, "SigBlk") == status(old, "SigBlk")
        assert child.xstate(new) == t.xstate(old)
        # libc's cached tid holds the new thread's tid as its own namespace sees it
        assert int.from_bytes(child.read(s.tid_addr, 4), "little") == c.vtid
        assert child.thread_altstack(new) == t.thread_altstack(old)


def test_threads_run_in_clone(procs, workers):
    pid, base = start_workers(procs, workers)
    with Tracee.seize(pid) as t:
        tids = t.stop_all()
        assert len(tids) == NCOUNT + 3
        src_words = words(pid, base)
        with t.clone() as child:
            procs.extra.append(child.pid)
            new = child.clone_threads(t)
            assert len(new) == len(tids) - 1 and tasks(child.pid) == {child.pid, *new}
            check_kernel_state(t, child, list(zip(tids[1:], new)))
            # counter 0 runs on a sigaltstack of its own; the others have none
            assert t.thread_altstack(src_words[TIDS]) != t.thread_altstack(src_words[TIDS + 1])
            child.write(base + 8 * TIDS, bytes(8 * NCOUNT))  # each thread must write it anew
            before = words(child.pid, base)
    assert before[COUNTERS:COUNTERS + NCOUNT] == src_words[COUNTERS:COUNTERS + NCOUNT]
    time.sleep(0.5)
    after = words(child.pid, base)
    assert all(a > b for a, b in zip(after[:NCOUNT], before[:NCOUNT])), (before, after)
    assert set(after[TIDS:TIDS + NCOUNT]) <= set(new)  # gettid() in the clone: its new tids
    assert after[NAPS] > before[NAPS] and after[NAPPER_TID] in new

    os.kill(child.pid, signal.SIGUSR1)  # main broadcasts; the waiter wakes, exits, is joined
    wait_for(lambda: words(child.pid, base)[JOINED] == 1, what="waiter joined in the clone")
    w = words(child.pid, base)
    assert w[USR1] == 1 and w[WOKE_TID] in new
    assert w[WOKE_TID] not in tasks(child.pid)

    # the parent: untouched, still waiting, still counting, and it wakes on its own signal
    p = words(pid, base)
    assert p[USR1] == 0 and p[WOKE_TID] == 0 and p[JOINED] == 0
    assert p[TIDS:TIDS + NCOUNT] == src_words[TIDS:TIDS + NCOUNT]
    assert all(a > b for a, b in zip(p[:NCOUNT], src_words[:NCOUNT]))
    os.kill(pid, signal.SIGUSR1)
    wait_for(lambda: words(pid, base)[JOINED] == 1, what="waiter joined in the parent")
    assert words(pid, base)[WOKE_TID] == src_words[WAITER_TID]


def pidns(procs, workers) -> int:
    _, line = procs.start([workers / "pidns_init"], ready="init")
    init = int(line.split()[1])
    procs.extra.append(init)  # killing the namespace's init ends everything inside it
    return init


def test_threads_keep_tids_in_pid_namespace(procs, workers):
    init = pidns(procs, workers)
    pid, base = start_workers(procs, workers)
    with Tracee.seize(pid) as t:
        tids = t.stop_all()
        with t.clone(pidns_owner=init, set_tid=pid) as child:
            procs.extra.append(child.pid)
            new = child.clone_threads(t)
            inner = {h: int(status(h, "NSpid").split()[-1]) for h in tasks(child.pid)}
            assert sorted(inner.values()) == sorted(tids)  # the same tids, in its namespace
            assert all(int(status(h, "NStgid").split()[-1]) == pid for h in inner)
            assert [inner[h] for h in new] == tids[1:]
            check_kernel_state(t, child, list(zip(tids[1:], new)))
            child.write(base + 8 * TIDS, bytes(8 * NCOUNT))
    src = words(pid, base)
    wait_for(lambda: all(words(child.pid, base)[TIDS:TIDS + NCOUNT]), what="threads' gettid")
    # gettid() in each recreated thread gives its original tid
    assert words(child.pid, base)[TIDS:TIDS + NCOUNT] == src[TIDS:TIDS + NCOUNT]
    os.kill(child.pid, signal.SIGUSR1)
    wait_for(lambda: words(child.pid, base)[JOINED] == 1, what="waiter joined in the clone")
    assert words(child.pid, base)[WOKE_TID] == src[WAITER_TID]
    assert words(pid, base)[JOINED] == 0


def report(p: Path, pid: int) -> dict:
    p.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    wait_for(p.exists, what=f"report of {pid}")
    return json.loads(p.read_text())


@pytest.mark.parametrize("own_ns", [False, True], ids=["same-pidns", "new-pidns"])
def test_python_threads_in_clone(procs, workers, tmp_path, own_ns):
    init = pidns(procs, workers) if own_ns else None
    out = tmp_path / "report.json"
    p, _ = procs.start([sys.executable, str(VICTIMS / "listers.py"), str(out)])
    time.sleep(0.2)
    with Tracee.seize(p.pid) as t:
        tids = t.stop_all()
        with t.clone(pidns_owner=init, set_tid=p.pid if own_ns else None) as child:
            procs.extra.append(child.pid)
            new = child.clone_threads(t)
    workers_now = sorted(tids[1:]) if own_ns else sorted(new)
    first = report(out, child.pid)  # clears the ids it has seen: the next holds fresh ones
    time.sleep(0.3)
    second = report(out, child.pid)
    assert first["pid"] == (p.pid if own_ns else child.pid)
    assert second["len"] > first["len"]
    assert second["ids"] == workers_now  # threading.get_native_id() in each worker
    assert report(out, p.pid)["ids"] == sorted(tids[1:])  # the parent still runs its own


def test_set_tid_in_use(procs, workers):
    init = pidns(procs, workers)
    pid, base = start_workers(procs, workers)
    with Tracee.seize(pid) as t:
        tids = t.stop_all()
        with t.clone(pidns_owner=init, set_tid=pid) as child:
            procs.extra.append(child.pid)
            st = t.thread_state(tids[1])
            with pytest.raises(ForkError) as ei:
                child.clone_thread(st, set_tid=pid)  # the clone's main thread has it
            assert ei.value.errno == errno.EEXIST and f"tid {pid}" in str(ei.value)
            assert ei.value.pid == child.pid
            assert tasks(child.pid) == {child.pid}

            # a failure after the clone3: the half-made thread is gone, the cached tid back
            bad = replace(st, rseq=(st.rseq[0], 7, st.rseq[2], 0))
            with pytest.raises(ForkError) as ei:
                child.clone_thread(bad)  # kernel-chosen tid: differs from the cached one
            assert ei.value.errno == errno.EINVAL and ei.value.step == "child"
            assert tasks(child.pid) == {child.pid}
            assert int.from_bytes(child.read(st.tid_addr, 4), "little") == st.vtid
            assert child.syscall(SYS_getpid) == pid  # the clone's control block still works

            new = child.clone_threads(t)  # and the real thing succeeds afterwards
            assert len(new) == len(tids) - 1
    before = words(child.pid, base)
    time.sleep(0.3)
    assert all(a > b for a, b in zip(words(child.pid, base)[:NCOUNT], before[:NCOUNT]))


def test_clone_threads_needs_all_stopped(procs, workers):
    pid, _ = start_workers(procs, workers)
    with Tracee.seize(pid) as t, t.clone() as child:
        procs.extra.append(child.pid)
        with pytest.raises(ForkError, match="stop_all"):
            child.clone_threads(t)
        assert tasks(child.pid) == {child.pid}


def test_cost_per_thread(procs, workers, capsys):
    pid, _ = start_workers(procs, workers)
    rt, per = [], []
    with Tracee.seize(pid) as t:
        tids = t.stop_all()
        states = [replace(t.thread_state(tid), altstack=t.thread_altstack(tid),
                          xstate=t.xstate(tid)) for tid in tids[1:]]
        with t.clone() as child:
            procs.extra.append(child.pid)
            for st in states:
                t0 = time.perf_counter()
                child.clone_thread(st)
                per.append(time.perf_counter() - t0)
            for _ in range(50):  # in the same (now multi-threaded) clone
                t0 = time.perf_counter()
                child.syscall(SYS_getpid)
                rt.append(time.perf_counter() - t0)
    thread_us, rt_us = statistics.median(per) * 1e6, statistics.median(rt) * 1e6
    with capsys.disabled():
        print(f"\n[compel threads] recreating one thread {thread_us:.0f} us vs an injected "
              f"getpid round trip {rt_us:.0f} us (medians, {len(per)} threads)")
    # a clone3 and two or three more injected calls. No upper bound: on a shared 2-core
    # machine the new thread's first run waits behind whatever else holds a CPU (ms).
    assert rt_us < thread_us
