"""A transplanted process's mappings (a process under another uid, fork/transplant.py): each
file is mapped again, opened through /proc/PID/map_files, and two files that a btrfs subvolume
and its snapshot number alike (/proc/PID/maps names the file system's device, not the
subvolume's) are still two files in the child; guard regions are made again, not copied."""

from __future__ import annotations

import json
import os
import signal

from conftest import SCRIPT_PRELUDE, fork_one, signal_and_read, start_script, wait_file

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


entering_by_itself = pytest.mark.skipif(
    not cloner().clone_enters_child, reason="the module's FORK forks such a process by cloning it")


@entering_by_itself
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


# as uid 1001: a guard page (MADV_GUARD_INSTALL) between two written pages; on SIGUSR1 reports
# which of the three pages the page map marks as guard, and the written bytes
_GUARDED = r"""
import ctypes, mmap, signal
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
PAGE = 4096
at = libc.mmap(None, 3 * PAGE, 3, 0x22, -1, 0)
ctypes.memset(at, ord("x"), PAGE)
ctypes.memset(at + 2 * PAGE, ord("z"), PAGE)
if libc.madvise(ctypes.c_void_p(at + PAGE), PAGE, 102) != 0:  # MADV_GUARD_INSTALL
    out('/tmp/ready', 'unsupported')
    raise SystemExit
os.setresgid(1001, 1001, 1001)
os.setresuid(1001, 1001, 1001)
libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: its /proc/self/pagemap is its own again

def report(*_):
    with open('/proc/self/pagemap', 'rb') as f:
        f.seek(at // PAGE * 8)
        ents = struct.unpack('3Q', f.read(24))
    out('/tmp/report', json.dumps([[e >> 58 & 1 for e in ents],
                                   ctypes.string_at(at, 1).decode() + ctypes.string_at(at + 2 * PAGE, 1).decode()]))

signal.signal(signal.SIGUSR1, report)
out('/tmp/ready', str(os.getpid()))
while True:
    time.sleep(0.05)
"""


@entering_by_itself
def test_a_guard_region_is_made_again_in_the_child(family):
    ws = start_script(family, _GUARDED, "/tmp/ready")
    ready = ws.read_file("/tmp/ready").decode()
    if ready == "unsupported":
        pytest.skip("no MADV_GUARD_INSTALL on this kernel (6.13+)")
    pid = int(ready)
    for w in (ws, fork_one(family, ws)):
        assert json.loads(signal_and_read(w, pid, signal.SIGUSR1, "/tmp/report")) == [[0, 1, 0], "xz"]
