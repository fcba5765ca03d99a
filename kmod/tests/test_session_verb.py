"""JOIN_SESSION: a process moved into another session and process group, checked in /proc and
by the session's terminal it then has."""
import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import errno_as_nobody
from test_fork_verb import errno_of

# A session leader on a pty of its own (so its session has a terminal), with one child in a
# group of its own; prints its pid and the child's.
LEADER = r"""
import os, pty, sys, time
pid, fd = pty.fork()            # the child: a new session, the pty its terminal
if pid == 0:
    kid = os.fork()
    if kid == 0:
        os.setpgid(0, 0)
        time.sleep(1000)
    print(os.getpid(), kid, flush=True)
    time.sleep(1000)
line = b""
while not line.endswith(b"\n"):  # a pty hands its output over in pieces
    line += os.read(fd, 100)
print(line.decode().strip(), flush=True)
time.sleep(1000)
"""


def stat(pid):
    """(pgrp, session, tty_nr) from /proc/PID/stat."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(f[2]), int(f[3]), int(f[4])


@pytest.fixture
def session():
    p = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    leader, kid = map(int, p.stdout.readline().split())
    yield leader, kid
    for pid in (kid, leader):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    p.kill()
    p.wait()


@pytest.fixture
def outsider():
    p = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    time.sleep(0.1)
    yield p.pid
    p.kill()
    p.wait()


def test_join_session_moves_session_group_and_terminal(dev, session):
    leader, kid = session
    # the one moved is a shell's child (a session leader could not be): another session's
    mover = subprocess.Popen(["sh", "-c", "sleep 1000 & echo $!; wait"], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        pid = int(mover.stdout.readline())
        before = stat(pid)
        assert before[1] != stat(leader)[1]
        req = dev.join_session(pid, leader, kid)
        assert (req.old_sid, req.old_pgid) == (before[1], before[0])
        pgrp, sid, tty = stat(pid)
        assert (pgrp, sid) == (kid, leader) and tty == stat(leader)[2] != 0
        req = dev.join_session(pid, leader, pid)  # a group of its own, in that session
        assert stat(pid)[:2] == (pid, leader)
        assert (req.old_sid, req.old_pgid) == (leader, kid)
    finally:
        os.killpg(mover.pid, 9)
        try:
            os.kill(pid, 9)  # in another session and group by now
        except (ProcessLookupError, NameError):
            pass
        mover.wait()


def test_join_session_bad_input(dev, session, outsider):
    leader, kid = session
    assert errno_of(dev.join_session, outsider, leader, outsider, flags=1) == errno.EINVAL
    assert errno_of(dev.join_session, outsider, leader, outsider, reserved=1) == errno.EINVAL
    assert errno_of(dev.join_session, 0, leader, leader) == errno.EINVAL
    # a session leader keeps its own session
    assert errno_of(dev.join_session, outsider, leader, outsider) == errno.EINVAL
    assert errno_of(dev.join_session, leader, outsider, leader) == errno.EINVAL
    # a group of another session
    assert errno_of(dev.join_session, kid, leader, outsider) == errno.EINVAL
    assert errno_of(dev.join_session, 1 << 22, leader, leader) == errno.ESRCH
    assert stat(outsider)[1] == outsider and stat(kid)[:2] == (kid, leader)  # nothing moved


def test_join_session_needs_privilege(dev, session):
    leader, kid = session
    assert errno_as_nobody(f"join_session({kid}, {leader}, {kid})") == errno.EPERM
