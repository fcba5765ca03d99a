"""The source's frozen copy and its first child's root, made beside the plan of a ws.fork()
(template.freeze_source): the child sees the files of the moment of the fork, also when a
vfork in flight let the source run while it was planned, and a refused fork leaves neither
the copy nor the root behind."""

from __future__ import annotations

import time

import pytest

import bunshin
from conftest import build_vforker, wait_file


def _spares_ready(ws: bunshin.Workspace, timeout: float = 10) -> None:
    """Wait for the directories and cgroups of the next fork (made after each fork)."""
    deadline = time.monotonic() + timeout
    while not (ws._spares is not None and ws._spares.slots):
        assert time.monotonic() < deadline, "no spare was made after a fork"
        time.sleep(0.01)


def _copies(ws: bunshin.Workspace) -> list[str]:
    return sorted(p.name for p in ws.state_path.iterdir() if p.name.startswith("frozen-"))


def _first_fork(family, ws: bunshin.Workspace) -> None:
    (kid,) = ws.fork(1)
    kid.close()
    _spares_ready(ws)


@pytest.mark.timeout(120)
def test_the_child_sees_the_files_of_the_moment_of_the_fork(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    _first_fork(family, ws)  # its spare is the next child's root, mounted beside the plan
    ws.write_file("/before", "1")
    (kid,) = ws.fork(1)
    family.append(kid)
    ws.write_file("/after", "2")
    ws.write_file("/before", "changed")
    assert kid.read_file("/before") == b"1"
    assert not kid.run("test -e /after").ok
    kid.write_file("/only-kid", "3")
    assert not ws.run("test -e /only-kid").ok


@pytest.mark.timeout(120)
def test_a_vfork_that_runs_during_the_plan_is_in_the_copy(family):
    """The group runs between the first freeze and the plan's (the vfork's child reaches its
    exec meanwhile): the copy taken at the first freeze is dropped and taken again."""
    ws = bunshin.Workspace.create()
    family.append(ws)
    _first_fork(family, ws)
    ws.spawn([build_vforker(ws), "300"])
    wait_file(ws, "/tmp/vforking", 20)
    (kid,) = ws.fork(1)
    family.append(kid)
    # the parent left vfork() before the fork's moment, so its write is the child's too
    for w in (ws, kid):
        child = int(wait_file(w, "/tmp/resumed", 20))
        assert int(w.read_file("/tmp/execd")) == child


@pytest.mark.timeout(120)
def test_a_refused_fork_leaves_no_copy_and_no_root(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    _first_fork(family, ws)
    before = _copies(ws)
    pid = ws.spawn([build_vforker(ws), "60000"])  # in vfork() for a minute: refused
    wait_file(ws, "/tmp/vforking", 20)
    spares = len(ws._spares.slots)
    with pytest.raises(bunshin.ForkError, match=r"vfork\(\)"):
        ws.fork(1)
    assert _copies(ws) == before
    # the spare taken for the child's root was removed with it (the leak check at the end
    # finds any directory or cgroup left)
    assert len(ws._spares.slots) <= spares
    assert ws.run("echo ok").stdout == b"ok\n"
    ws.kill(pid, 9)
    ws.run("pkill -9 -f '^/v' || true")
    (kid,) = ws.fork(1)
    family.append(kid)
    assert kid.run("echo ok").stdout == b"ok\n"
