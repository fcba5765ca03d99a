"""Locked memory across a fork: mlockall(MCL_FUTURE) (with MCL_ONFAULT, or with MCL_CURRENT:
every mapping locked), which /proc does not show, and a range locked with
mlock2(MLOCK_ONFAULT). The process reports what it has itself: the VmFlags of a mapping it
makes after the fork, and of its locked range."""

from __future__ import annotations

import signal

import pytest

from conftest import fork_one, signal_and_read, start_script

LOCKER = r"""
import ctypes, mmap, signal
libc = ctypes.CDLL(None, use_errno=True)
MCL_FUTURE, MCL_ONFAULT, MLOCK_ONFAULT, SYS_mlock2 = 2, 4, 1, 325
MCL_CURRENT = 1
future = MCL_FUTURE | (MCL_ONFAULT if sys.argv[1] == "onfault" else MCL_CURRENT)
ranged = mmap.mmap(-1, 1 << 20)
at = ctypes.addressof(ctypes.c_char.from_buffer(ranged))
assert libc.syscall(SYS_mlock2, ctypes.c_void_p(at), ctypes.c_size_t(8192), MLOCK_ONFAULT) == 0, ctypes.get_errno()
assert libc.mlockall(future) == 0, ctypes.get_errno()

def vmflags(addr):
    head = "%x-" % addr
    lines = open("/proc/self/smaps").read().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(head))
    return next(line.split()[1:] for line in lines[at:] if line.startswith("VmFlags:"))

def report(sig, frame):
    new = mmap.mmap(-1, 4096)
    fresh = vmflags(ctypes.addressof(ctypes.c_char.from_buffer(new)))
    out("/tmp/seen", json.dumps({"new": [f for f in fresh if f in ("lo", "lf")],
                                 "range": [f for f in vmflags(at) if f in ("lo", "lf")]}))

signal.signal(signal.SIGUSR1, report)
out("/tmp/ready", "")
while True:
    signal.pause()
"""


def _seen(w, pid: int) -> dict:
    import json

    return json.loads(signal_and_read(w, pid, signal.SIGUSR1, "/tmp/seen"))


@pytest.mark.parametrize("how", ["populate", "onfault"])
def test_mlockall_future_and_locked_ranges_carried(family, how):
    ws = start_script(family, LOCKER, "/tmp/ready", how)
    (pid,) = [p.pid for p in ws.processes() if p.cmdline[-2:] == ["/t.py", how]]
    # MCL_CURRENT locks the range again, populated
    want = {"new": ["lo", "lf"], "range": ["lo", "lf"]} if how == "onfault" else {"new": ["lo"], "range": ["lo"]}
    assert _seen(ws, pid) == want
    kid = fork_one(family, ws)
    assert _seen(kid, pid) == want
    assert _seen(ws, pid) == want
    with ws.snapshot() as tpl:
        (grandkid,) = tpl.fork(1)
        family.append(grandkid)
        assert _seen(grandkid, pid) == want
    assert _seen(ws, pid) == want


UNLOCKED = r"""
import mmap, signal

def report(sig, frame):
    new = mmap.mmap(-1, 4096)
    out("/tmp/seen", open("/proc/self/status").read().split("VmLck:")[1].split()[0])

signal.signal(signal.SIGUSR1, report)
out("/tmp/ready", "")
while True:
    signal.pause()
"""


def test_unlocked_process_stays_unlocked(family):
    ws = start_script(family, UNLOCKED, "/tmp/ready")
    (pid,) = [p.pid for p in ws.processes() if p.cmdline[-1:] == ["/t.py"]]
    kid = fork_one(family, ws)
    assert signal_and_read(kid, pid, signal.SIGUSR1, "/tmp/seen") == b"0"
    assert signal_and_read(ws, pid, signal.SIGUSR1, "/tmp/seen") == b"0"
