"""Workloads the fork benchmarks share: a workspace with a shell and a memory-holding Python.

The Python worker touches every page of its buffer (non-zero bytes, so neither the zero page nor
a lazy allocation hides memory) and measures its own fork(): on SIGUSR2 it times ``os.fork()``
(the child ``_exit``s at once), waits for the child, and appends the duration of the fork() call
in seconds as one line to a file. The same worker runs inside a workspace (``ws.spawn``) and as a
plain host process (for the CRIU baseline), so both sides fork the same program.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass

import bunshin

__all__ = [
    "WORKER",
    "Loaded",
    "build_workspace",
    "native_bash_forks",
    "native_python_forks",
    "start_host_worker",
    "wait_lines",
]

WORKER = r"""
import os, signal, sys, time
mib, out = int(sys.argv[1]), sys.argv[2]
buf = bytearray(b"\x5a") * (mib << 20)          # memset: every page resident, none the zero page
def on_usr2(sig, frame):
    t = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    d = time.perf_counter() - t
    os.waitpid(pid, 0)
    with open(out, "a") as f:
        f.write(repr(d) + "\n")
signal.signal(signal.SIGUSR2, on_usr2)
open(out + ".ready", "w").close()
while True:
    signal.pause()
"""

FORK_LOG = "/tmp/bunshin-bench-fork.log"  # inside the workspace (its /tmp is private)


@dataclass
class Loaded:
    """A workspace with a bash session and, when ``mib``, a Python worker holding ``mib`` MiB."""

    ws: bunshin.Workspace
    sh: object  # bunshin Shell
    pid: int | None  # the worker's pid inside the workspace
    mib: int

    def close(self) -> None:
        self.ws.close()


def _wait(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.002)


def build_workspace(mib: int = 0, **create_kw) -> Loaded:
    """init + a bash session (``ws.shell()``) + (``mib`` > 0) the Python worker, ready."""
    ws = bunshin.Workspace.create(**create_kw)
    try:
        sh = ws.shell()
        sh.run("true")
        pid = None
        if mib:
            pid = ws.spawn(["python3", "-c", WORKER, str(mib), FORK_LOG])
            _wait(lambda: _readable(ws, FORK_LOG + ".ready"), 120, f"the {mib} MiB worker to be ready")
        return Loaded(ws, sh, pid, mib)
    except BaseException:
        ws.close()
        raise


def _readable(ws: bunshin.Workspace, path: str) -> bool:
    try:
        ws.read_file(path, max_bytes=1)
        return True
    except bunshin.BunshinError:
        return False


def _lines(ws: bunshin.Workspace) -> list[str]:
    try:
        return ws.read_file(FORK_LOG).decode().split()
    except bunshin.BunshinError:
        return []


def wait_lines(get, n: int, timeout: float = 30) -> list[str]:
    """Poll ``get()`` (a list of lines) until it has ``n`` lines; return them."""
    box: list[list[str]] = [[]]

    def ok() -> bool:
        box[0] = get()
        return len(box[0]) >= n

    _wait(ok, timeout, f"{n} fork measurements")
    return box[0]


def native_python_forks(ld: Loaded, n: int) -> list[float]:
    """``n`` fork() durations (seconds) measured by the worker itself, one SIGUSR2 at a time."""
    have = len(_lines(ld.ws))
    for i in range(n):
        ld.ws.kill(ld.pid, signal.SIGUSR2)
        wait_lines(lambda: _lines(ld.ws), have + i + 1)
    return [float(x) for x in _lines(ld.ws)[have:have + n]]


def native_bash_forks(sh, n: int) -> list[float]:
    """``n`` durations of bash's ``( : )`` subshell in the session, timed by bash itself with
    $EPOCHREALTIME: fork + the child's exit + waitpid, an upper bound of the fork() call."""
    script = (f"for _i in $(seq {n}); do _t0=$EPOCHREALTIME; ( : ); _t1=$EPOCHREALTIME; "
              "echo \"$_t0 $_t1\"; done")
    r = sh.run(script, timeout=60)
    out = []
    for line in r.stdout.decode().splitlines():
        parts = line.split()
        if len(parts) == 2:
            out.append(float(parts[1]) - float(parts[0]))
    if len(out) != n:
        raise RuntimeError(f"bash fork timing: expected {n} lines, got {r.stdout[-300:]!r}")
    return out


def start_host_worker(mib: int, out: str) -> subprocess.Popen:
    """The same worker as a plain host process in its own session (stdio /dev/null), ready."""
    p = subprocess.Popen(["python3", "-c", WORKER, str(mib), out], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait(lambda: os.path.exists(out + ".ready") or p.poll() is not None, 120,
              f"the {mib} MiB host worker")
        if p.poll() is not None:
            raise RuntimeError(f"host worker exited with {p.returncode}")
    except BaseException:
        p.kill()
        p.wait()
        raise
    return p
