"""An open file processes share (inherited across fork(2): `cmd > log` and its workers) is one
open file in each child of a template too, shared by the child's processes alone: a write by
one moves the other's offset, and no child's or the source's moves another's. The process
and its worker report what they see (tests/fidelity/victims/shared_files.c), in two children
of one template and in the source."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import bunshin

VICTIM = Path(__file__).parent / "fidelity" / "victims" / "shared_files.c"


def _verdict(w, pid: int) -> str:
    w.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            return w.read_file("/tmp/fid-verdict").decode().strip()
        except bunshin.BunshinError:
            time.sleep(0.02)
    return "no verdict"


def test_each_child_shares_its_own(family, tmp_path):
    exe = tmp_path / "shared_files"
    subprocess.run(["cc", "-O1", "-o", str(exe), str(VICTIM)], check=True)
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.write_file("/victim", exe.read_bytes(), mode=0o755)
    pid = ws.spawn(["/victim"], cwd="/tmp")
    deadline = time.monotonic() + 15
    while ws.run("test -e /tmp/fid-ready").exit_code:
        assert time.monotonic() < deadline, "the victim never became ready"
        time.sleep(0.02)
    with ws.snapshot() as tpl:
        kids = tpl.fork(2)
    family.extend(kids)
    for w in (*kids, ws):  # one after another: each would see another's writes if they shared
        assert _verdict(w, pid) == "PASS", w
