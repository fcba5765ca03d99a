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
    "GUI_DISPLAY",
    "REDIS_KEYS",
    "WORKER",
    "Loaded",
    "build_gui_workspace",
    "build_server_workspace",
    "build_workspace",
    "http_ok",
    "native_bash_forks",
    "native_python_forks",
    "native_redis_forks",
    "redis_cli",
    "start_host_worker",
    "wait_lines",
]

WORKER = r"""
import os, signal, sys, time
mib, out = int(sys.argv[1]), sys.argv[2]
if sys.argv[3:] == ["distinct"]:  # no two pages alike (what KSM could merge, an image could not)
    buf = bytearray(os.urandom(mib << 20))
else:
    buf = bytearray(b"\x5a") * (mib << 20)      # memset: every page resident, none the zero page
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


def build_workspace(mib: int = 0, distinct: bool = False, **create_kw) -> Loaded:
    """init + a bash session (``ws.shell()``) + (``mib`` > 0) the Python worker, ready (its
    pages all alike, or ``distinct``)."""
    ws = bunshin.Workspace.create(**create_kw)
    try:
        sh = ws.shell()
        sh.run("true")
        pid = None
        if mib:
            pid = ws.spawn(["python3", "-c", WORKER, str(mib), FORK_LOG, *(["distinct"] if distinct else [])])
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


# ---- application workloads: a server workspace (Redis + http.server) and a GUI one (Xvfb) ----

REDIS_PORT = 6390
REDIS_KEYS = 100_000
HTTP_PORT = 8000
GUI_DISPLAY = {"DISPLAY": ":9"}
_REDIS_CLI = f"redis-cli -p {REDIS_PORT}"


def redis_cli(ws: bunshin.Workspace, *args: str) -> bytes:
    return ws.exec(["redis-cli", "-p", str(REDIS_PORT), *args]).stdout.strip()


def build_server_workspace() -> Loaded:
    """init + bash + Redis holding ``REDIS_KEYS`` keys (DEBUG POPULATE) + ``python3 -m
    http.server``, both answering."""
    ld = build_workspace(0)
    ws = ld.ws
    try:
        ws.spawn(["redis-server", "--port", str(REDIS_PORT), "--save", "", "--appendonly", "no",
                  "--daemonize", "no", "--dir", "/tmp", "--enable-debug-command", "yes"],
                 log_path="/tmp/redis.log")
        _wait(lambda: redis_cli(ws, "ping") == b"PONG", 30, "redis-server to answer PING")
        r = redis_cli(ws, "debug", "populate", str(REDIS_KEYS))
        if r != b"OK" or redis_cli(ws, "dbsize") != str(REDIS_KEYS).encode():
            raise RuntimeError(f"DEBUG POPULATE failed: {r!r}")
        ws.spawn(["python3", "-m", "http.server", str(HTTP_PORT), "--bind", "127.0.0.1"], cwd="/tmp",
                 log_path="/tmp/http.log")
        _wait(lambda: http_ok(ws), 30, "http.server to answer")
        return ld
    except BaseException:
        ld.close()
        raise


def http_ok(ws: bunshin.Workspace) -> bool:
    r = ws.run(f"exec 3<>/dev/tcp/127.0.0.1/{HTTP_PORT} && printf 'GET / HTTP/1.0\\r\\n\\r\\n' >&3 "
               "&& head -c 12 <&3", timeout=10)
    return r.exit_code == 0 and r.stdout.startswith(b"HTTP/1.0 200")


def native_redis_forks(sh, n: int) -> list[float]:
    """``n`` fork() durations (seconds) as Redis reports them itself: BGSAVE, wait until the
    save child is done and reaped, then ``INFO stats`` ``latest_fork_usec``."""
    script = (f"for _i in $(seq {n}); do {_REDIS_CLI} bgsave >/dev/null || exit 1; "
              f"while {_REDIS_CLI} info persistence | grep -q 'rdb_bgsave_in_progress:1'; do sleep 0.005; done; "
              f"{_REDIS_CLI} info persistence | grep -q 'rdb_last_bgsave_status:ok' || exit 2; "
              f"{_REDIS_CLI} info stats | grep latest_fork_usec; done")
    r = sh.run(script, timeout=120)
    out = [int(line.split(":")[1]) * 1e-6 for line in r.stdout.decode().split()
           if line.startswith("latest_fork_usec:")]
    if len(out) != n:
        raise RuntimeError(f"redis fork timing: expected {n} values, got {r.stdout[-300:]!r} "
                           f"(exit {r.exit_code})")
    return out


def build_gui_workspace() -> Loaded:
    """init + bash + Xvfb :9 (1280x800x24, MIT-SHM framebuffer) + xeyes + xclock, drawn."""
    ld = build_workspace(0)
    ws = ld.ws
    try:
        ws.spawn(["Xvfb", GUI_DISPLAY["DISPLAY"], "-screen", "0", "1280x800x24", "-nolisten", "tcp",
                  "-shmem", "-noreset"], log_path="/tmp/xvfb.log")
        _wait(lambda: ws.run("xwd -root -silent >/dev/null 2>&1", env=GUI_DISPLAY).ok, 30, "Xvfb")
        ws.spawn(["xeyes", "-geometry", "300x200+20+20"], env=GUI_DISPLAY)
        ws.spawn(["xclock", "-geometry", "200x200+400+200"], env=GUI_DISPLAY)
        _wait(lambda: ws.run("xdotool search --name xeyes && xdotool search --name xclock",
                             env=GUI_DISPLAY).ok, 30, "xeyes and xclock windows")
        time.sleep(0.3)  # let both draw
        return ld
    except BaseException:
        ld.close()
        raise
