"""A transplanted process (one under another uid, fork/transplant.py) maps each of its files
again, opened through /proc/PID/map_files: two files that a btrfs subvolume and its snapshot
number alike (/proc/PID/maps names the file system's device, not the subvolume's) are still
two files in the child."""

from __future__ import annotations

import json
import os
import signal

from conftest import SCRIPT_PRELUDE, fork_one, signal_and_read, wait_file

import bunshin
from bunshin.fork.cloners import cloner

import pytest

# maps two files as uid 1001 and, on SIGUSR1, reports the first byte of each mapping
_MAPPER = SCRIPT_PRELUDE + r"""
import mmap, signal
fa, fb = open('/lib-a', 'rb'), open('/lib-b', 'rb')
ma = mmap.mmap(fa.fileno(), 0, prot=mmap.PROT_READ)
mb = mmap.mmap(fb.fileno(), 0, prot=mmap.PROT_READ)
os.setresgid(1001, 1001, 1001)
os.setresuid(1001, 1001, 1001)
signal.signal(signal.SIGUSR1, lambda *a: out('/tmp/report', json.dumps([ma[:1].decode(), mb[:1].decode()])))
out('/tmp/ready', str(os.getpid()))
while True:
    time.sleep(0.05)
"""


@pytest.mark.skipif(not cloner().clone_enters_child,
                    reason="the module's FORK forks such a process by cloning it")
def test_two_files_numbered_alike_in_two_layers_stay_two_files(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.write_file("/lib-a", b"A" * 8192)
    tpl = ws.snapshot()
    try:
        (kid,) = tpl.fork(1)
        family.append(kid)
    finally:
        tpl.close()
    lower = json.loads((kid.state_path / "meta.json").read_text())["lowers"][0]
    ino = os.stat(os.path.join(lower, "lib-a")).st_ino
    upper = kid.state_path / "layer" / "upper"
    for i in range(400):  # new files in the kid's own upper until one is numbered as /lib-a
        kid.write_file(f"/fill/{i}", b"")
        if os.stat(upper / "fill" / str(i)).st_ino + 1 == ino:
            break
    kid.write_file("/lib-b", b"B" * 8192)
    assert os.stat(upper / "lib-b").st_ino == ino, "no file of the kid's layer numbered as /lib-a"
    kid.write_file("/t.py", _MAPPER)
    kid.spawn(["python3", "/t.py"])
    pid = int(wait_file(kid, "/tmp/ready"))
    for w in (kid, fork_one(family, kid)):
        assert json.loads(signal_and_read(w, pid, signal.SIGUSR1, "/tmp/report")) == ["A", "B"]
