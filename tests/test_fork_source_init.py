"""ws.fork()'s first child's init is cloned from the source's while the source's upper layer is
copied, and is sent into its root once that copy is mounted (fork/template.py,
_init_beside_copy): from the workspace's second fork on, when a spare is ready. Each child is
whole all the same, and the source runs on."""

from __future__ import annotations

import signal
import time

import pytest

import bunshin
from conftest import signal_and_read

# A process that checks itself when told (SIGUSR1): its pid, a descriptor open on a file
# written before the fork, its working directory; it reports its host name and whether it
# sees a file written after the fork.
_CHECKER = r"""
import os, signal, socket, time
os.chdir("/srv")
with open("/srv/before", "w") as f:
    f.write("before")
fd = os.open("/srv/before", os.O_RDONLY)
me = os.getpid()
def check(*_):
    os.lseek(fd, 0, 0)
    ok = os.getpid() == me and os.read(fd, 16) == b"before" and os.getcwd() == "/srv"
    seen = "after" if os.path.exists("/srv/after") else "no-after"
    with open("/tmp/verdict", "w") as f:
        f.write(f"PASS {socket.gethostname()} {seen}" if ok else "FAIL")
signal.signal(signal.SIGUSR1, check)
open("/tmp/ready", "w").close()
while True:
    time.sleep(1)
"""


def _start(ws: bunshin.Workspace) -> int:
    ws.run("mkdir -p /srv")
    ws.write_file("/tmp/checker.py", _CHECKER)
    pid = ws.spawn(["python3", "/tmp/checker.py"])
    deadline = time.monotonic() + 10
    while ws.run("test -e /tmp/ready").exit_code != 0:
        assert time.monotonic() < deadline, "the checker did not start"
        time.sleep(0.02)
    return pid


def _verdict(w: bunshin.Workspace, pid: int) -> str:
    return signal_and_read(w, pid, signal.SIGUSR1, "/tmp/verdict").decode()


def _wait_spare(ws: bunshin.Workspace) -> None:
    """The spare the previous fork asked for (slots.py), so the next fork clones its child's
    init beside the copy."""
    deadline = time.monotonic() + 10
    while not (ws._spares is not None and ws._spares.slots):
        assert time.monotonic() < deadline, "no spare made"
        time.sleep(0.01)


@pytest.mark.parametrize("n", [1, 2])
def test_forks_one_after_another(family, n):
    ws = bunshin.Workspace.create(hostname="src")
    family.append(ws)
    pid = _start(ws)
    for round_ in range(3):
        if round_:
            _wait_spare(ws)
        kids = ws.fork(n)
        family.extend(kids)
        ws.write_file("/srv/after", b"x")
        for kid in kids:
            assert _verdict(kid, pid) == "PASS src no-after"
            assert kid.run("cat /srv/before").stdout == b"before"
            assert kid.run("hostname").stdout.strip() == b"src"
        assert _verdict(ws, pid) == "PASS src after"
        ws.run("rm /srv/after")
    for kid in family[1:]:
        kid.close()
    del family[1:]
    # only the source's processes are left under its pid namespace: no init made for a child
    # outlived it
    assert sorted(ws.run("ps -e -o comm=").stdout.split()) == sorted(
        [b"bunshin-init", b"python3", b"ps"])


def test_a_fork_that_fails_after_its_init_was_made_leaves_nothing(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    pid = _start(ws)
    family.extend(ws.fork(1))  # makes the spare the next fork uses
    _wait_spare(ws)

    def refuse(_kid):
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        ws.fork(1, on_fork=refuse)
    family[1].close()
    del family[1:]
    assert _verdict(ws, pid) == "PASS " + ws.run("hostname").stdout.decode().strip() + " no-after"
    assert sorted(ws.run("ps -e -o comm=").stdout.split()) == sorted(
        [b"bunshin-init", b"python3", b"ps"])
    kid = ws.fork(1)[0]  # a failed fork asks for no spare: this one makes its own
    family.append(kid)
    assert _verdict(kid, pid).startswith("PASS ")
