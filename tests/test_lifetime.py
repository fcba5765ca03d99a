"""A trainer that dies takes its workspaces' processes with it; `bunshin gc` removes the rest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import run_python

CHILD = r"""
import json, sys, time, bunshin
ws = bunshin.Workspace.create()
pid = ws.spawn(["sleep", "1000"])
sh = ws.shell(); sh.run("sleep 1000 &")
print(json.dumps({"init": ws.init_pid, "pids": ws.host_pids(), "state": str(ws.state_path),
                  "cgroup": ws.cgroup.dirs()}), flush=True)
time.sleep(1000)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_owner_death_kills_workspace_processes_and_gc_cleans(no_leaks):
    # without its watcher (test_owner_death.py), which would clean up before gc can
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), BUNSHIN_OWNER_WATCH="0")
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, env=env)
    try:
        info = json.loads(p.stdout.readline())
    finally:
        p.kill()
        p.wait()
    assert len(info["pids"]) >= 4  # init, sleep, bash, background sleep
    deadline = time.monotonic() + 5
    while any(_alive(x) for x in info["pids"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(_alive(x) for x in info["pids"]), "workspace processes outlived their owner"
    # The owner could not clean its files and cgroup; gc does.
    assert Path(info["state"]).exists() and all(Path(d).exists() for d in info["cgroup"])
    r = run_python("from bunshin.runtime import gc; print(gc.collect(dry_run=True))")
    assert Path(info["state"]).name in r.stdout
    assert Path(info["state"]).exists()
    r = subprocess.run([sys.executable, "-m", "bunshin", "gc"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "removed" in r.stdout, r.stderr
    assert not Path(info["state"]).exists()
    assert not any(Path(d).exists() for d in info["cgroup"])


def test_gc_spares_live_workspaces(ws):
    from bunshin.runtime import gc

    assert ws.id not in gc.collect()
    assert ws.run("echo alive").stdout == b"alive\n"


def test_gc_spares_a_running_cgroup_of_another_state_dir(no_leaks):
    """Two trainers may share the cgroup prefix with different state directories: a group with
    processes that this state directory does not know is not ours to remove."""
    from bunshin.runtime import cgroup, gc

    cg = cgroup.backend().create("ws-other-trainer")
    p = subprocess.Popen(["sleep", "1000"])
    try:
        cg.add(p.pid)
        assert "cgroup:ws-other-trainer" not in gc.collect()
        assert cg.pids() == [p.pid] and p.poll() is None
    finally:
        p.kill()
        p.wait()
    assert "cgroup:ws-other-trainer" in gc.collect()
