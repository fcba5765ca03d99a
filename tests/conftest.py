"""Shared fixtures. Every test session runs in its own state dir and cgroup prefix, and ends
with a leak check: no workspace dirs, cgroups, init processes or mounts may survive it."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

_SESSION_TMP = Path(tempfile.mkdtemp(prefix="bunshin-test-"))
os.environ.setdefault("BUNSHIN_STATE_DIR", str(_SESSION_TMP / "state"))
os.environ.setdefault("BUNSHIN_CGROUP_PREFIX", f"bunshin-test-{os.getpid()}")
# what the library leaves in the temporary directory on purpose (a failed CRIU run's log,
# named in its error) goes with the session
(_SESSION_TMP / "tmp").mkdir()
tempfile.tempdir = str(_SESSION_TMP / "tmp")


def init_processes() -> list[int]:
    """Host pids of every bunshin-init on the machine started by this test session."""
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            exe = os.readlink(f"/proc/{name}/exe")
            with open(f"/proc/{name}/stat", "rb") as f:
                st = f.read()
        except OSError:
            continue
        ppid = int(st[st.rindex(b")") + 2 :].split()[1])
        if os.path.basename(exe).startswith("bunshin-init") and ppid == me:
            found.append(int(name))
    return found


def ws_status(ws, pid: int, key: str) -> str:
    """One field of /proc/PID/status as the workspace ``ws`` sees it (PID its own)."""
    for line in ws.read_file(f"/proc/{pid}/status").decode().splitlines():
        if line.startswith(key + ":"):
            value = line.split(":", 1)[1].strip()
            if key in ("Uid", "Gid", "Groups"):  # the trainer reads them as the host names them
                from bunshin.runtime.userns import inside

                kind = "uid" if key == "Uid" else "gid"
                sep = "\t" if "\t" in value else " "
                value = sep.join(str(i) for i in inside(ws.init_pid, kind, map(int, value.split())))
            return value
    raise KeyError(key)


def leaks() -> dict[str, list]:
    """What of ours is still around: state dirs, cgroup dirs, inits, host mounts."""
    from bunshin import config

    out: dict[str, list] = {}
    ws_dir = config.state_dir() / "ws"
    out["state_dirs"] = sorted(p.name for p in ws_dir.iterdir()) if ws_dir.exists() else []
    cg = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        fstype = fields[fields.index("-") + 1]
        if fstype in ("cgroup", "cgroup2"):
            top = Path(fields[4]) / config.cgroup_prefix()
            if top.exists():
                cg += [str(p) for p in top.iterdir() if p.is_dir()]
    out["cgroups"] = cg
    out["inits"] = init_processes()
    mounts = Path("/proc/self/mountinfo").read_text()
    # the state file system itself stays mounted until the session ends
    out["mounts"] = [l for l in mounts.splitlines()
                     if str(config.state_dir()) + "/" in l.split()[4] + "/" and l.split()[4] != str(config.state_dir())]
    return {k: v for k, v in out.items() if v}


def wait_no_leaks(timeout: float = 5.0) -> dict[str, list]:
    deadline = time.monotonic() + timeout
    while (found := leaks()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


@pytest.fixture(scope="session", autouse=True)
def _session_leak_check():
    yield
    from bunshin.runtime import statefs

    found = wait_no_leaks()
    statefs.release()
    mounts = [l for l in Path("/proc/self/mountinfo").read_text().splitlines() if str(_SESSION_TMP) in l]
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)
    assert not found, f"the test session leaked: {found}"
    assert not mounts, f"the test session left mounts: {mounts}"


@pytest.fixture
def no_leaks():
    """Asserts that the test left nothing behind (use in tests that create workspaces)."""
    yield
    found = wait_no_leaks()
    assert not found, f"test leaked: {found}"


@pytest.fixture
def ws(no_leaks):
    import bunshin

    w = bunshin.Workspace.create()
    yield w
    w.close()


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run a Python snippet in a fresh interpreter that sees this checkout."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture
def family(no_leaks):
    """A list the test appends workspaces to; they are closed (children first) afterwards."""
    made: list = []
    yield made
    for w in reversed(made):
        w.close()


def signal_and_read(w, pid: int, sig: int, path: str, timeout: float = 15) -> bytes:
    """Ask a test program in workspace ``w`` to report: remove ``path``, send ``sig`` to
    ``pid`` (a pid inside ``w``), and return what the program writes there."""
    w.run(f"rm -f {path}")
    w.kill(pid, sig)
    wait_file(w, path, timeout)
    return w.read_file(path)


def wait_file(w, path: str, timeout: float = 15) -> str:
    """Contents of ``path`` in workspace ``w`` once it exists."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if w.run(f"test -e {path}").exit_code == 0:
            return w.read_file(path).decode()
        time.sleep(0.02)
    raise AssertionError(f"{path} never appeared in {w.id}")


def fork_by(w, path: str):
    """One child of workspace ``w`` by ``path``: "ws_fork" (ws.fork) or "tpl_fork" (a
    snapshot's fork, the template closed at once)."""
    if path == "ws_fork":
        return w.fork(1)[0]
    with w.snapshot() as tpl:
        return tpl.fork(1)[0]


def build_vforker(w) -> str:
    """tests/victims/vforker.c built in workspace ``w``; its path there."""
    w.write_file("/v.c", (Path(__file__).parent / "victims" / "vforker.c").read_text())
    assert w.run("gcc -O1 -pthread -o /v /v.c").ok
    return "/v"


def put(w, path: str, text: str) -> None:
    """Write ``path`` in workspace ``w`` for a program there that waits for it to appear:
    atomically (a temporary file renamed into place), since ``write_file`` creates the file
    before it writes the bytes and a program polling for it could read it empty."""
    w.write_file(path + ".part", text)
    root = f"/proc/{w.init_pid}/root"
    os.rename(root + path + ".part", root + path)


SCRIPT_PRELUDE = """
import os, sys, time, socket, json, struct
def wait(p):
    while not os.path.exists(p):
        time.sleep(0.01)
def out(p, text):
    open(p + '.tmp', 'w').write(text)
    os.rename(p + '.tmp', p)
"""
"""Prepended to the Python scripts the fork tests run: ``wait(path)`` for a file to appear,
``out(path, text)`` to write one atomically."""


def start_script(family, script: str, ready: str, *args: str):
    """A new workspace (in ``family``) running ``SCRIPT_PRELUDE + script`` as /t.py, once the
    script has created ``ready``."""
    import bunshin

    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.write_file("/t.py", SCRIPT_PRELUDE + script)
    ws.spawn(["python3", "/t.py", *args])
    wait_file(ws, ready)
    return ws


def fork_one(family, ws):
    """One fork of ``ws``, closed with ``family``."""
    (kid,) = ws.fork(1)
    family.append(kid)
    return kid


def wait_for_bytes(w, path: str, want: bytes, timeout: float = 15) -> bytes:
    """Contents of ``path`` in workspace ``w`` once they contain ``want`` (or, at the timeout,
    whatever they are then, for the caller's assertion to show)."""
    import bunshin

    deadline = time.monotonic() + timeout
    data = b""
    while time.monotonic() < deadline:
        try:
            data = w.read_file(path)
        except bunshin.ToolCallError:
            data = b""
        if want in data:
            return data
        time.sleep(0.02)
    return data
