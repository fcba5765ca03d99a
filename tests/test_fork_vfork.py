"""A fork taken while a process is in vfork(): its parent cannot stop until the child execs,
and both share one address space, so the snapshot lets the child reach its exec first."""

from __future__ import annotations

import time

import pytest

import bunshin
from conftest import build_vforker, wait_file

def _in_vfork(ws, ms: int) -> int:
    pid = ws.spawn([build_vforker(ws), str(ms)])
    wait_file(ws, "/tmp/vforking", 20)
    time.sleep(0.2)
    assert not ws.run("test -e /tmp/resumed").ok  # still waiting for its child's exec
    return pid


@pytest.mark.timeout(120)
def test_fork_during_vfork_waits_for_the_exec_and_both_run_on(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    parent = _in_vfork(ws, 1200)
    (kid,) = ws.fork(1)
    family.append(kid)
    for w in (ws, kid):
        child = int(wait_file(w, "/tmp/resumed", 20))  # the parent left vfork() in the child too
        assert int(w.read_file("/tmp/execd")) == child
        assert w.run(f"cat /proc/{child}/comm").stdout == b"sleep\n"
        ppid = int(w.run(f"awk '/^PPid/ {{print $2}}' /proc/{child}/status").stdout)
        assert ppid in (parent, 1)  # parent links: exact with the module only
    kid.write_file("/tmp/only-kid", "x")
    assert not ws.run("test -e /tmp/only-kid").ok


@pytest.mark.timeout(120)
def test_vfork_that_never_execs_is_a_clear_error_and_the_source_runs_on(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    parent = _in_vfork(ws, 60000)
    t0 = time.monotonic()
    with pytest.raises(bunshin.ForkError, match=r"vfork\(\).*has not called exec") as e:
        ws.fork(1)
    assert time.monotonic() - t0 >= 0.9 * bunshin.fork.template.VFORK_WAIT_S
    assert e.value.step == "snapshot"
    # the source was thawed: the vfork child still sleeps in it, and it takes tool calls
    assert ws.run("echo ok").stdout == b"ok\n"
    assert ws.run(f"test -d /proc/{parent}").ok
    assert not ws.run("test -e /tmp/resumed").ok
