"""Slots: the state directory, cgroup and overlay root of a template's next children, made in
the background after tpl.fork(n) and taken by the next call (bunshin/fork/slots.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import bunshin
from bunshin import config
from bunshin.runtime import cgroup


def _wait_slots(core, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while len(core.slots) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(core.slots) == n, f"{len(core.slots)} slots ready, wanted {n}"


def _state_ids() -> set[str]:
    try:
        return set(os.listdir(config.state_dir() / "ws"))
    except FileNotFoundError:  # gc released the state file system: nothing is left
        return set()


def _assert_removed(ids: set[str]) -> None:
    """Neither the state directories nor the cgroups of these slots (spares) exist."""
    assert not ids & _state_ids()
    assert not {f"ws-{i}" for i in ids} & set(cgroup.backend().list())


def _close_removes_unused(holder, n: int, close) -> set[str]:
    """Once ``n`` slots (spares) are ready again, ``close()`` removes them all; their ids."""
    _wait_slots(holder, n)
    unused = {s.dir.id for s in holder.slots}
    close()
    assert not holder.slots
    _assert_removed(unused)
    return unused


def test_next_fork_takes_the_slots_and_close_removes_unused_ones():
    ws = bunshin.Workspace.create()
    tpl = ws.snapshot()
    kids: list[bunshin.Workspace] = []
    try:
        core = tpl._core
        kids += tpl.fork(2)
        _wait_slots(core, 2)
        ready = {s.dir.id for s in core.slots}
        assert {f"ws-{i}" for i in ready} <= set(cgroup.backend().list())
        # another process's gc sees a live owner and leaves them alone
        out = subprocess.run([sys.executable, "-m", "bunshin", "gc", "--dry-run"], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert not ready & set(out.stdout.split()), out.stdout
        more = tpl.fork(2)
        kids += more
        assert {k.id for k in more} == ready
        for i, k in enumerate(more):
            k.write_file("/tmp/mine", f"child {i}")
        assert [k.read_file("/tmp/mine") for k in more] == [b"child 0", b"child 1"]
        assert ws.run("test -e /tmp/mine").exit_code == 1
        unused = _close_removes_unused(core, 2, tpl.close)
        assert "bunshin" not in "".join(line for line in open("/proc/self/mountinfo")
                                        if any(i in line for i in unused))
        assert kids[0].run("echo alive").stdout == b"alive\n"  # children outlive the handle
    finally:
        tpl.close()
        for k in kids:
            k.close()
        ws.close()


def _pids_max(ws: bunshin.Workspace) -> str:
    cg = ws.cgroup
    path = os.path.join(cg.path if isinstance(cg, cgroup.V2Cgroup) else cg._by["pids"], "pids.max")
    with open(path) as f:
        return f.read().strip()


def test_ws_fork_takes_spares_made_after_the_last_and_close_removes_them():
    """ws.fork()'s template is the workspace, for one call (no slots): it gets spares instead,
    directories and cgroups with its limits, for its next ws.fork() or snapshot()."""
    ws = bunshin.Workspace.create(pids_limit=77)
    kids: list[bunshin.Workspace] = []
    try:
        kids += ws.fork(2)
        spares = ws._spares
        _wait_slots(spares, 2)  # as many as the last call's children
        ready = {s.dir.id for s in spares.slots}
        assert {f"ws-{i}" for i in ready} <= set(cgroup.backend().list())
        more = ws.fork(1)
        kids += more
        assert more[0].id in ready
        assert _pids_max(more[0]) == _pids_max(ws) == "77"
        more[0].write_file("/tmp/mine", "child")
        assert ws.run("test -e /tmp/mine").exit_code == 1
        _close_removes_unused(spares, 1, ws.close)
        assert more[0].run("echo alive").stdout == b"alive\n"
    finally:
        for k in kids:
            k.close()
        ws.close()


def test_ws_fork_and_restore_only_where_asked(monkeypatch):
    ws = bunshin.Workspace.create()
    kids: list[bunshin.Workspace] = []
    try:
        before = _state_ids()
        kids += ws.fork(2)  # its template is never forked again: no slots made for it
        _wait_slots(ws._spares, 2)  # but spares, for the workspace's next fork
        spares = {s.dir.id for s in ws._spares.slots}
        assert _state_ids() - before == {k.id for k in kids} | spares
        monkeypatch.setenv("BUNSHIN_FORK_SLOTS", "0")
        tpl = ws.snapshot()
        try:
            kids += tpl.fork(1)
            time.sleep(0.2)
            assert tpl._core.slots == []
        finally:
            tpl.close()
    finally:
        for k in kids:
            k.close()
        ws.close()


def test_a_slot_left_by_a_dead_trainer_is_collected(tmp_path):
    """A trainer killed with slots ready: gc removes their directories and cgroups."""
    code = (
        "import time, bunshin, json\n"
        "ws = bunshin.Workspace.create(); tpl = ws.snapshot(); k = tpl.fork(1)\n"
        "deadline = time.monotonic() + 10\n"
        "while not tpl._core.slots and time.monotonic() < deadline: time.sleep(0.01)\n"
        "print(json.dumps([s.dir.id for s in tpl._core.slots]), flush=True)\n"
        "time.sleep(60)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        ids = json.loads(p.stdout.readline())
        assert ids and set(ids) <= _state_ids()
    finally:
        p.kill()
        p.wait()
    out = subprocess.run([sys.executable, "-m", "bunshin", "gc"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    _assert_removed(set(ids))
