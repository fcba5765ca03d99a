"""A process under a seccomp filter forks like any other: the engine's injected calls (and the
fixups in its clone) are not subject to the filter, and the clone keeps the filter."""

from __future__ import annotations

import signal

import bunshin
from conftest import signal_and_read, wait_file

# Kills the process on setns and pidfd_open (calls a fork injects), fails uname with EPERM (the
# probe that shows the filter is still there), allows everything else.
FILTERED = r"""
import ctypes, os, signal, struct
libc = ctypes.CDLL(None, use_errno=True)
RET_ALLOW, RET_KILL_PROCESS, RET_EPERM = 0x7FFF0000, 0x80000000, 0x00050000 | 1
prog = [(0x20, 0, 0, 4), (0x15, 1, 0, 0xC000003E), (0x06, 0, 0, RET_ALLOW),  # x86_64 only
        (0x20, 0, 0, 0)]                                                     # the call's number
for nr, ret in ((308, RET_KILL_PROCESS), (434, RET_KILL_PROCESS), (63, RET_EPERM)):
    prog += [(0x15, 0, 1, nr), (0x06, 0, 0, ret)]
prog.append((0x06, 0, 0, RET_ALLOW))
raw = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
fprog = struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(raw))
assert libc.prctl(38, 1, 0, 0, 0) == 0                    # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) == 0  # PR_SET_SECCOMP, FILTER
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
open("/tmp/ready", "w").close()
while True:
    signal.sigwait({signal.SIGUSR1})
    try:
        os.uname()
        seen = "allowed"
    except PermissionError:
        seen = "EPERM"
    with open("/tmp/probe.tmp", "w") as f:
        f.write(seen)
    os.rename("/tmp/probe.tmp", "/tmp/probe")
"""


def test_filtered_process_forks_and_keeps_its_filter(no_leaks):
    with bunshin.Workspace.create() as ws:
        ws.write_file("/filtered.py", FILTERED)
        pid = ws.spawn(["python3", "/filtered.py"])
        wait_file(ws, "/tmp/ready")
        assert ws.run(f"grep -x 'Seccomp:.2' /proc/{pid}/status").exit_code == 0
        (kid,) = ws.fork(1)
        try:
            for w in (ws, kid):  # the source's process survived, the clone exists
                assert pid in {p.pid for p in w.processes()}
                assert w.run(f"grep -x 'Seccomp:.2' /proc/{pid}/status").exit_code == 0
                assert signal_and_read(w, pid, signal.SIGUSR1, "/tmp/probe") == b"EPERM"
        finally:
            kid.close()


# A trainer under a seccomp filter of its own (allow-all) cannot suspend filters: it may fork
# processes that only inherited its filter, and refuses one that added its own, cleanly.
FILTERED_TRAINER = r"""
import ctypes, json, struct, sys, time
libc = ctypes.CDLL(None, use_errno=True)
allow = struct.pack("HBBI", 0x06, 0, 0, 0x7FFF0000)
raw = ctypes.create_string_buffer(allow)
assert libc.prctl(38, 1, 0, 0, 0) == 0
assert libc.prctl(22, 2, ctypes.c_char_p(struct.pack("HxxxxxxQ", 1, ctypes.addressof(raw))), 0, 0) == 0
import bunshin
from bunshin import compel
from bunshin.errors import ForkError
out = {}
with bunshin.Workspace.create() as ws:
    sleeper = ws.spawn(["sleep", "1000"])
    (kid,) = ws.fork(1)  # its processes carry only the trainer's filter
    out["plain_fork"] = sorted(p.pid for p in kid.processes())
    kid.close()
    out["suspends"] = compel.suspends_seccomp()
    ws.write_file("/filtered.py", sys.argv[1])
    pid = ws.spawn(["python3", "/filtered.py"])
    while ws.run("test -e /tmp/ready").exit_code:
        time.sleep(0.05)
    try:
        ws.fork(1)
        out["error"] = None
    except ForkError as e:
        out["error"] = str(e)
    out["alive"] = sorted(p.pid for p in ws.processes())
    out["pid"], out["sleeper"] = pid, sleeper
    out["after"] = ws.run("echo ok").stdout.decode()
print(json.dumps(out))
"""


def test_trainer_that_cannot_suspend_filters_refuses_cleanly(no_leaks):
    import json
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", FILTERED_TRAINER, FILTERED], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.splitlines()[-1])
    assert out["suspends"] is False
    assert out["error"] and f"process {out['pid']} (python3)" in out["error"]
    assert "seccomp filter of its own" in out["error"]
    assert {out["pid"], out["sleeper"]} <= set(out["alive"])  # the source is intact
    assert out["after"] == "ok\n"
    assert len(out["plain_fork"]) == 2  # init and sleep
