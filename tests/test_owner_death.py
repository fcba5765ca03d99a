"""A trainer that ends without closing its workspaces leaves nothing behind: its watcher
(runtime/owner_watch.py) removes them when it is killed, and its atexit hook when it exits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from bunshin.runtime import cgroup, statedir

# A trainer that makes a workspace, a template of it, two children of the template and a fork
# of the workspace, prints where they live, then ends as ARGV[1] says.
TRAINER = r"""
import json, os, signal, sys, time
import bunshin
ws = bunshin.Workspace.create()
ws.spawn(["sleep", "1000"])
tpl = ws.snapshot()
kids = tpl.fork(2) + ws.fork(1)
assert all(k.run("echo ok").stdout == b"ok\n" for k in kids)
print(json.dumps({"ids": [w.id for w in [ws, *kids]] + [tpl.id],
                  "inits": [w.init_pid for w in [ws, *kids]]}), flush=True)
how = sys.argv[1]
if how == "exit":
    sys.exit(0)
if how == "_exit":
    os._exit(0)
time.sleep(1000)
"""


def _ours_left(owner: int, ids: list[str], inits: list[int]) -> list[str]:
    """What the trainer ``owner`` made that is still there: directories (its spare ones for
    the next forks included), cgroups, inits."""
    dirs = [d for d in statedir.all_dirs() if (m := d.read_meta()) is None or m.owner_pid == owner]
    ids = ids + [d.id for d in dirs]
    left = [f"dir {d.id}" for d in dirs]
    left += [f"cgroup ws-{i}" for i in set(ids) if f"ws-{i}" in cgroup.backend().list()]
    for pid in inits:
        try:
            if os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith("bunshin-init"):
                left.append(f"init {pid}")
        except OSError:
            pass
    return left


@pytest.mark.parametrize("how", ["SIGKILL", "exit", "_exit"])
def test_nothing_is_left_when_the_trainer_ends_without_closing(how, tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    p = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE, text=True)
    try:
        made = json.loads(p.stdout.readline())
        assert made["ids"] and len(made["inits"]) == 4
        if how == "SIGKILL":
            p.send_signal(signal.SIGKILL)
        p.wait(30)
    finally:
        p.kill()
        p.wait()
    deadline = time.monotonic() + 5
    while (left := _ours_left(p.pid, made["ids"], made["inits"])) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"still there 5 s after the trainer ended ({how}): {left}"
