"""A trainer holds thousands of descriptors of its own: every wait of the library must work on
descriptors numbered 1024 and above (select() cannot watch those)."""

from __future__ import annotations

import os
import resource

import pytest

import bunshin
from bunshin import kerndat

HELD = 1100


@pytest.fixture
def many_fds():
    """More than 1024 descriptors open, so every one the library opens next is numbered above."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < HELD + 500:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below {HELD + 500}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, HELD + 500), hard))
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(HELD)]
    try:
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_workspaces_fork_and_close_with_descriptors_above_1024(many_fds, tmp_path):
    probe = os.open("/dev/null", os.O_RDONLY)
    os.close(probe)
    assert probe >= 1024  # what the library opens now is out of select()'s reach
    ws = bunshin.Workspace.create()
    try:
        # an inotify watch: forking it drains the copy's own events through a poll
        ws.spawn(["python3", "-c", "import ctypes, os, time\n"
                  "libc = ctypes.CDLL(None); fd = libc.inotify_init1(0)\n"
                  "assert libc.inotify_add_watch(fd, b'/tmp', 0x100) > 0\n"
                  "open('/tmp/ready', 'w').close(); time.sleep(1000)\n"])
        ws.run("while [ ! -e /tmp/ready ]; do sleep 0.02; done", timeout=20)
        kids = ws.fork(2)
        tpl = ws.snapshot()
        kids += tpl.fork(2)
        for kid in kids:
            assert kid.run("echo ok").stdout == b"ok\n"
        for kid in kids:
            kid.close()
        tpl.close()
    finally:
        ws.close()


def test_the_machine_probe_runs_with_descriptors_above_1024(many_fds):
    kd = kerndat.probe()
    assert kd.pidfd_open  # a probe that ran and answered, not one that failed on its pipe


def test_the_trainer_limit_is_raised_and_workspaces_keep_the_machine_s(tmp_path):
    """In a fresh trainer with soft < hard: the first workspace raises the trainer's soft limit
    to the hard one; the workspace's programs still see the soft limit the trainer started with."""
    import subprocess
    import sys

    script = tmp_path / "t.py"
    script.write_text(
        "import resource, bunshin\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (1000, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "with bunshin.Workspace.create() as ws:\n"
        "    print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], ws.run('ulimit -Sn').stdout.decode().strip(),\n"
        "          ws.fork(1)[0].run('ulimit -Sn').stdout.decode().strip())\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert out.stdout.split() == [str(hard), "1000", "1000"]
