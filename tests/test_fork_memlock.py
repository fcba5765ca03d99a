"""Locked memory across a fork: mlockall(MCL_FUTURE) (with MCL_ONFAULT, or with MCL_CURRENT:
every mapping locked), which /proc does not show, and a range locked with
mlock2(MLOCK_ONFAULT). The process reports what it has itself: the VmFlags of a mapping it
makes after the fork, and of its locked range (tests/victims/locker.c)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

import bunshin
from conftest import fork_one, signal_and_read, start_script, wait_file


def _seen(w, pid: int) -> dict:
    import json

    return json.loads(signal_and_read(w, pid, signal.SIGUSR1, "/tmp/seen"))


@pytest.mark.parametrize("how", ["populate", "onfault"])
def test_mlockall_future_and_locked_ranges_carried(family, how):
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.write_file("/locker.c", (Path(__file__).parent / "victims" / "locker.c").read_text())
    assert ws.run("gcc -O1 -Wall -Werror -o /locker /locker.c").ok
    pid = ws.spawn(["/locker", how])
    wait_file(ws, "/tmp/ready")
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
