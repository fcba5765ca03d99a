"""Hostile tool calls: the host and other workspaces must not notice, and the workspace says
what happened and stays usable."""

from __future__ import annotations

import os
import time

import pytest

import bunshin


def _only_init_left(w, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if [p.pid for p in w.processes()] == [1]:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_fork_bomb_is_contained_by_the_pids_limit(no_leaks):
    with bunshin.Workspace.create(pids_limit=64) as w, bunshin.Workspace.create() as other:
        w.run(":(){ :|:& };:", timeout=3)  # returns at once: the bomb runs in the background
        time.sleep(0.5)
        assert w.cgroup.stats().pids_max_events > 0  # the limit did the containing
        assert len(w.host_pids()) <= 64
        w.kill_all()
        assert _only_init_left(w)
        assert w.run("echo alive").stdout == b"alive\n"
        assert other.run("echo unaffected").stdout == b"unaffected\n"
        assert os.fork.__call__ is not None and os.system("true") == 0  # the host can still fork


def test_memory_hog_is_oom_killed_inside(no_leaks):
    with bunshin.Workspace.create(memory_limit="96M") as w:
        r = w.run("python3 -c 'b = bytearray(1 << 30); b[::4096] = b\"x\" * (len(b) // 4096)'",
                  timeout=60)
        assert r.exit_code == 137 and r.signal == 9 and r.oom_killed, r
        assert w.cgroup.stats().oom_kills >= 1
        assert w.run("echo survived").stdout == b"survived\n"


def test_kill_minus_one_spares_init(ws):
    sh = ws.shell()
    ws.spawn(["sleep", "100"])
    r = ws.run("kill -9 -1; echo survived-own-kill")  # kill(-1) spares the caller and init
    assert r.stdout == b"survived-own-kill\n"
    assert _only_init_left(ws)
    r = sh.run("echo x")  # the session's bash was killed: reported once, then refused
    assert r.exit_code == 137 and r.signal == 9
    with pytest.raises(bunshin.ShellExited):
        sh.run("echo x")
    assert ws.run("echo alive").stdout == b"alive\n"
    assert ws.shell().run("echo new shell").stdout == b"new shell\n"


@pytest.mark.slow
def test_rm_rf_root_only_touches_the_upper_layer(no_leaks, tmp_path):
    probe = "/usr/bin/env"
    before = os.stat(probe)
    with bunshin.Workspace.create() as w, bunshin.Workspace.create() as other:
        r = w.run("rm -rf --no-preserve-root / 2>/dev/null; echo gone", timeout=120)
        assert r.stdout == b"gone\n"  # echo is a builtin: sh still runs
        # Tools are gone inside: the workspace reports it instead of hanging.
        r = w.run("true")
        assert r.exit_code == 127
        assert not w.run("ls /").ok
        # whiteouts in the upper layer are what changed
        upper = w.body.dir.upper / "usr"
        assert upper.exists()
        assert os.stat(probe).st_ino == before.st_ino and os.path.exists("/bin/sh")
        assert other.run("ls /usr/bin/env && echo ok").stdout.endswith(b"ok\n")
    assert os.path.exists(probe)


def test_endless_output_is_capped_and_timed_out(ws):
    start = time.monotonic()
    r = ws.run("yes", timeout=1, max_output=1 << 20)
    assert r.timed_out and r.truncated and len(r.stdout) == 1 << 20
    assert time.monotonic() - start < 5
    assert ws.run("echo next").stdout == b"next\n"


def test_network_is_unreachable(ws):
    r = ws.run("python3 -c \"import socket; s=socket.socket(); s.settimeout(2); "
               "s.connect(('198.51.100.7', 80))\"")
    assert r.exit_code != 0 and b"Network is unreachable" in r.stderr
