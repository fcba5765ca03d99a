"""Shared memory, timers and signals across a fork."""

from __future__ import annotations

import time

import pytest

import bunshin
from bunshin.errors import ForkError

SHARED = r"""
import mmap, os, signal, sys
anon = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_SHARED)
mfd = os.memfd_create("state")
os.ftruncate(mfd, 1 << 16)
mem = mmap.mmap(mfd, 1 << 16, flags=mmap.MAP_SHARED)
shm_fd = os.open("/dev/shm/seg", os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(shm_fd, 4096)
shm = mmap.mmap(shm_fd, 4096, flags=mmap.MAP_SHARED)
for m in (anon, mem, shm):
    m[:5] = b"start"
pid = os.fork()
role = "child" if pid == 0 else "parent"
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})
open(f"/tmp/ready-{role}", "w").close()
while True:
    sig = signal.sigwait({signal.SIGUSR1, signal.SIGUSR2})
    if sig == signal.SIGUSR1 and role == "parent":   # the writer
        for m in (anon, mem, shm):
            m[:5] = b"wrote"
    elif sig == signal.SIGUSR2:                        # report what this process sees
        with open(f"/tmp/seen-{role}", "w") as f:
            f.write(" ".join(bytes(m[:5]).decode() for m in (anon, mem, shm)))
"""


def _wait(w, cmd, timeout=20):
    deadline = time.monotonic() + timeout
    while not w.run(cmd).ok:
        assert time.monotonic() < deadline, cmd
        time.sleep(0.05)


def _seen(w, pid, role):
    w.run(f"rm -f /tmp/seen-{role}")
    w.kill(pid, 12)
    _wait(w, f"test -s /tmp/seen-{role}")
    return w.read_file(f"/tmp/seen-{role}").decode()


def test_shared_memory_becomes_the_childs_own_copy(no_leaks):
    with bunshin.Workspace.create() as ws:
        ws.write_file("/shared.py", SHARED)
        ws.spawn(["python3", "/shared.py"])
        _wait(ws, "test -e /tmp/ready-parent && test -e /tmp/ready-child")
        procs = {p.cmdline[-1]: p.pid for p in ws.processes() if p.cmdline[:1] == ["python3"]}
        parent, child = sorted(p.pid for p in ws.processes() if p.cmdline[:1] == ["python3"])
        del procs
        (kid,) = ws.fork(1)
        try:
            kid.kill(parent, 10)  # the writer writes in the forked workspace only
            time.sleep(0.3)
            # inside the fork, both of its processes see the write: still shared among them
            assert _seen(kid, child, "child") == "wrote wrote wrote"
            assert _seen(kid, parent, "parent") == "wrote wrote wrote"
            # the source sees none of it: the fork got its own copies
            assert _seen(ws, child, "child") == "start start start"
            assert ws.run("head -c 5 /dev/shm/seg").stdout == b"start"
            assert kid.run("head -c 5 /dev/shm/seg").stdout == b"wrote"
        finally:
            kid.close()


def test_interval_timers_are_rearmed(no_leaks):
    with bunshin.Workspace.create() as ws:
        ws.write_file("/tick.py", "import signal, time\nn = 0\n"
                                  "def tick(*_):\n    global n\n    n += 1\n    open('/tmp/ticks', 'w').write(str(n))\n"
                                  "signal.signal(signal.SIGALRM, tick)\n"
                                  "signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)\n"
                                  "while True: time.sleep(1)\n")
        ws.spawn(["python3", "/tick.py"])
        _wait(ws, "test -s /tmp/ticks")
        (kid,) = ws.fork(1)
        try:
            a = int(kid.read_file("/tmp/ticks"))
            time.sleep(0.5)
            assert int(kid.read_file("/tmp/ticks")) > a  # fork(2) alone would have dropped the timer
        finally:
            kid.close()


def test_posix_timers_and_sysv_shm_are_refused(no_leaks):
    with bunshin.Workspace.create() as ws:
        ws.spawn(["python3", "-c", "import ctypes, time\nlib = ctypes.CDLL(None)\n"
                                   "t = ctypes.c_void_p()\nlib.timer_create(1, None, ctypes.byref(t))\n"
                                   "open('/tmp/ok', 'w').close()\ntime.sleep(1000)"])
        _wait(ws, "test -e /tmp/ok")
        with pytest.raises(ForkError, match="POSIX timers"):
            ws.fork(1)
        assert ws.run("echo alive").stdout == b"alive\n"
    with bunshin.Workspace.create() as ws:
        ws.spawn(["python3", "-c", "import ctypes, time\nlib = ctypes.CDLL(None)\n"
                                   "lib.shmat.restype = ctypes.c_void_p\n"
                                   "i = lib.shmget(0, 4096, 0o1600)\nlib.shmat(i, None, 0)\n"
                                   "open('/tmp/ok', 'w').close()\ntime.sleep(1000)"])
        _wait(ws, "test -e /tmp/ok")
        with pytest.raises(ForkError, match="SysV shared memory"):
            ws.fork(1)
        assert ws.run("echo alive").stdout == b"alive\n"
