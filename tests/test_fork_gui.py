"""An X display across a fork: Xvfb (framebuffer in SysV shared memory) with X clients; the
child's screen is pixel-identical right after the fork, then each side is driven differently
with xdotool and the screens diverge; both servers keep accepting new clients."""

from __future__ import annotations

import hashlib
import shutil
import struct
from pathlib import Path
import time

import pytest

import bunshin

pytestmark = pytest.mark.skipif(shutil.which("Xvfb") is None or shutil.which("xdotool") is None,
                                reason="xvfb, x11-apps and xdotool are installed by scripts/install-deps.sh")

DISPLAY = {"DISPLAY": ":7"}


def _shot(w) -> bytes:
    """md5 of the root window's xwd dump: header, colormap and pixels, less the pad byte of
    each colormap entry, which xwd copies from XColor.pad that XQueryColors never sets (its
    heap's leftovers: they differed between two dumps of one screen)."""
    r = w.run("xwd -root -silent", env=DISPLAY, max_output=16 << 20)
    assert r.ok and not r.truncated, r
    dump = bytearray(r.stdout)
    (header_size,), (ncolors,) = struct.unpack_from(">I", dump), struct.unpack_from(">I", dump, 4 * 19)
    for i in range(ncolors):  # XWDColor: pixel u32, red/green/blue u16, flags u8, pad u8
        dump[header_size + 12 * i + 11] = 0
    return hashlib.md5(dump).hexdigest().encode()


def _wait(w, cmd: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not (r := w.run(cmd, env=DISPLAY)).ok:
        if time.monotonic() >= deadline:  # say what the display was doing
            log = w.run("cat /tmp/xvfb.log").stdout.decode(errors="replace")[-2000:]
            procs = [(p.pid, p.state, " ".join(p.cmdline)) for p in w.processes()]
            raise AssertionError(f"{cmd}: still failing after {timeout}s: {r}\n"
                                 f"processes: {procs}\nXvfb log: {log}")
        time.sleep(0.05)


def test_xvfb_and_clients_fork(no_leaks):
    with bunshin.Workspace.create() as ws:
        # -noreset: the server reset after xdpyinfo leaves can refuse the next client (seen
        # under load: xeyes and xclock gone before the fork)
        ws.spawn(["Xvfb", ":7", "-screen", "0", "640x480x24", "-nolisten", "tcp", "-shmem",
                  "-noreset"], log_path="/tmp/xvfb.log")
        _wait(ws, "xdpyinfo >/dev/null 2>&1 || xwd -root -silent >/dev/null")
        ws.spawn(["xeyes", "-geometry", "200x150+10+10"], env=DISPLAY)
        ws.spawn(["xclock", "-geometry", "150x150+300+200", "-update", "3600"], env=DISPLAY)
        _wait(ws, "xdotool search --name xeyes && xdotool search --name xclock")
        time.sleep(0.5)  # let both draw
        assert "SYSV" in ws.read_file(f"/proc/{ws.processes()[1].pid}/maps").decode()  # -shmem framebuffer
        before = _shot(ws)
        (kid,) = ws.fork(1)
        try:
            assert _shot(kid) == _shot(ws) == before  # pixel-identical right after the fork
            kid.run("xdotool search --name xeyes windowmove 400 300", env=DISPLAY)
            ws.run("xdotool search --name xclock windowmove 20 300", env=DISPLAY)
            time.sleep(0.5)
            a, b = _shot(ws), _shot(kid)
            assert a != b and a != before and b != before
            # both servers accept new clients, independently
            kid.spawn(["xeyes", "-geometry", "100x100+0+0"], env=DISPLAY)
            _wait(kid, "test $(xdotool search --name xeyes | wc -l) -eq 2")
            assert ws.run("xdotool search --name xeyes | wc -l", env=DISPLAY).stdout.strip() == b"1"
        finally:
            kid.close()


def test_mit_shm_client_forks(no_leaks):
    """A client that draws through MIT-SHM: its SysV segment (shared with the X server) is
    recreated with the same id in the child, and each side's client keeps painting its own."""
    src = (Path(__file__).parent / "victims" / "shmpaint.c").read_text()
    with bunshin.Workspace.create() as ws:
        ws.write_file("/shmpaint.c", src)
        r = ws.run("gcc -O1 -o /shmpaint /shmpaint.c -lX11 -lXext")
        assert r.ok, r
        ws.spawn(["Xvfb", ":7", "-screen", "0", "640x480x24", "-nolisten", "tcp", "-noreset"], log_path="/tmp/xvfb.log")
        _wait(ws, "xwd -root -silent >/dev/null")
        client = ws.spawn(["/shmpaint", "336699"], env=DISPLAY)
        _wait(ws, "test -s /tmp/painted")
        time.sleep(0.3)
        before = _shot(ws)
        (kid,) = ws.fork(1)
        try:
            assert _shot(kid) == before
            assert kid.run("ipcs -m | grep -c 0x00000000").stdout.strip() == \
                ws.run("ipcs -m | grep -c 0x00000000").stdout.strip()  # same segments, same ids
            kid.run("rm /tmp/painted")
            kid.kill(client, 10)  # the child's client repaints through its own segment
            _wait(kid, "test -s /tmp/painted")
            time.sleep(0.3)
            assert _shot(kid) != before and _shot(ws) == before
        finally:
            kid.close()
