"""isolation="sandbox": the container-runtime defaults (bunshin.sandbox) are applied by the
init, kept by every process, and carried by ws.fork and tpl.fork, with the fork's exact tree,
transplants and a process's own seccomp filters working under them."""

from __future__ import annotations

import json

import pytest

import bunshin
from bunshin import sandbox
from conftest import SCRIPT_PRELUDE, fork_one, wait_file, ws_status

_DROPPED = sum(1 << bit for bit, _ in sandbox.DROPPED_CAPS.values())


def test_isolation_is_checked(no_leaks):
    with pytest.raises(bunshin.IsolationError, match="isolation must be one of .*'sandbox'"):
        bunshin.Workspace.create(isolation="strict")
    with pytest.raises(bunshin.IsolationError):
        bunshin.Workspace.create(isolation=1)


def test_a_trusted_workspace_is_as_before(no_leaks):
    with bunshin.Workspace.create(isolation="trusted") as ws:
        assert ws.config.isolation == "trusted"
        assert ws_status(ws, 1, "Seccomp_filters") == "0"
        assert int(ws_status(ws, 1, "CapBnd"), 16) & _DROPPED == _DROPPED
        assert ws.run("grep -c ' /proc/sys ' /proc/self/mountinfo").stdout == b"0\n"


# The process checks itself: its filter and capabilities, a denied call, an allowed one, the
# masks, the IPC namespace's sysctls it may write; then again on SIGUSR1 (in a child too).
_SELF = r"""
import ctypes, errno, signal
libc = ctypes.CDLL(None, use_errno=True)
def state():
    st = {l.split(':')[0]: l.split()[1] for l in open('/proc/self/status')
          if l.startswith(('Seccomp_filters', 'CapBnd', 'CapEff', 'NoNewPrivs'))}
    got = libc.syscall(249, b"user", b"x", None, 0)  # request_key: denied
    st["request_key"] = errno.errorcode.get(ctypes.get_errno(), "0") if got < 0 else "done"
    st["getpgid"] = libc.syscall(121, 0) >= 0  # allowed
    st["kcore"] = os.path.exists("/proc/kcore") and os.path.getsize("/proc/kcore")
    try:
        open("/proc/sys/vm/swappiness", "w").write("60")
        st["swappiness"] = "written"
    except OSError as e:
        st["swappiness"] = errno.errorcode[e.errno]
    open("/proc/sys/kernel/msgmax", "w").write("12345")
    st["msgmax"] = open("/proc/sys/kernel/msgmax").read().strip()
    return st
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
out('/tmp/ready', json.dumps(state()))
while True:
    signal.sigwait({signal.SIGUSR1})
    out('/tmp/report', json.dumps(state()))
"""


def _sandbox_script(family, script: str, ready: str):
    ws = bunshin.Workspace.create(isolation="sandbox")
    family.append(ws)
    ws.write_file("/t.py", SCRIPT_PRELUDE + script)
    ws.spawn(["python3", "/t.py"])
    wait_file(ws, ready)
    return ws


def _report(w, pid: int) -> dict:
    w.run("rm -f /tmp/report")
    w.kill(pid, 10)
    return json.loads(wait_file(w, "/tmp/report"))


def test_a_process_keeps_the_defaults_in_the_source_and_every_child(family):
    ws = _sandbox_script(family, _SELF, "/tmp/ready")
    first = json.loads(ws.read_file("/tmp/ready"))
    assert first["Seccomp_filters"] == "1" and int(first["CapBnd"], 16) & _DROPPED == 0
    assert int(first["CapEff"], 16) & _DROPPED == 0
    assert first["request_key"] == "EPERM" and first["getpgid"] is True
    assert first["kcore"] in (False, 0)
    assert first["swappiness"] == "EROFS" and first["msgmax"] == "12345"
    (pid,) = [p.pid for p in ws.processes() if p.pid != 1 and "python3" in p.cmdline[0]]
    kid = fork_one(family, ws)
    with ws.snapshot() as tpl:
        (from_tpl,) = tpl.fork(1)
    family.append(from_tpl)
    for w in (kid, from_tpl, ws):
        assert w.config.isolation == "sandbox"
        assert _report(w, pid) == first, w
        assert ws_status(w, 1, "Seccomp_filters") == "1"
        assert int(ws_status(w, 1, "CapBnd"), 16) & _DROPPED == 0
        assert w.run("grep -c ' /proc/sys ro,' /proc/self/mountinfo").stdout == b"1\n"
        assert w.run("ls -A /sys/firmware").stdout == b""


def test_a_shells_jobs_stay_its_children_in_a_fork(family):
    """The exact tree holds under the init's filter, which every process has."""
    ws = bunshin.Workspace.create(isolation="sandbox")
    family.append(ws)
    sh = ws.shell()
    sh.run("sleep 1000 & sleep 1001 &")
    me = sh.run("echo $$").stdout.strip()
    for kid in [fork_one(family, ws), *_tpl_kids(family, ws)]:
        ksh = kid.shells[0]
        for job in ksh.run("jobs -p").stdout.split():
            assert ksh.run(f"ps -o ppid= -p {job.decode()}").stdout.strip() == me
        assert ksh.run("grep Seccomp_filters /proc/$$/status").stdout.split()[1] == b"1"


def _tpl_kids(family, ws):
    with ws.snapshot() as tpl:
        kids = tpl.fork(1)
    family.extend(kids)
    return kids


# a uid-1001 process under a filter of its own (getpgid fails with 77): a transplant in
# every child, which must have the init's filter once and its own once
_FILTERED = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
os.setresgid(1001, 1001, 1001)
os.setresuid(1001, 1001, 1001)
libc.prctl(38, 1, 0, 0, 0)
code = b''.join(struct.pack("HBBI", *i) for i in [
    (0x20, 0, 0, 0), (0x15, 0, 1, 121), (0x06, 0, 0, 0x50000 | 77), (0x06, 0, 0, 0x7fff0000)])
insns = ctypes.create_string_buffer(code)
prog = ctypes.create_string_buffer(struct.pack("H6xQ", 4, ctypes.addressof(insns)))
assert libc.prctl(22, 2, prog, 0, 0) == 0
out('/tmp/ready', str(os.getpid()))
while True:
    time.sleep(0.05)
    got = libc.syscall(121, 0)
    e77 = ctypes.get_errno()
    rk = libc.syscall(249, b"user", b"x", None, 0)
    status = {l.split(':')[0]: l.split()[1] for l in open('/proc/self/status')
              if l.startswith(('Seccomp_filters', 'Uid'))}
    out('/tmp/state', json.dumps([got, e77, rk, ctypes.get_errno(), status]))
"""


def test_a_process_under_another_uid_with_its_own_filter_forks(family):
    ws = _sandbox_script(family, _FILTERED, "/tmp/ready")
    want = [-1, 77, -1, 1, {"Uid": "1001", "Seccomp_filters": "2"}]
    assert json.loads(wait_file(ws, "/tmp/state")) == want
    for w in [fork_one(family, ws), *_tpl_kids(family, ws), ws]:
        w.run("rm -f /tmp/state")
        assert json.loads(wait_file(w, "/tmp/state")) == want, w


_FILTERED_TRAINER = r"""
import ctypes, json, struct
libc = ctypes.CDLL(None, use_errno=True)
raw = ctypes.create_string_buffer(struct.pack("HBBI", 0x06, 0, 0, 0x7FFF0000))  # allow all
assert libc.prctl(38, 1, 0, 0, 0) == 0
assert libc.prctl(22, 2, ctypes.c_char_p(struct.pack("HxxxxxxQ", 1, ctypes.addressof(raw))), 0, 0) == 0
import bunshin
from bunshin import compel
with bunshin.Workspace.create(isolation="sandbox") as ws:
    ws.spawn(["sleep", "1000"])
    (kid,) = ws.fork(1)
    out = {"suspends": compel.suspends_seccomp(),
           "kid": sorted(p.cmdline[0] for p in kid.processes()),
           "echo": kid.run("echo ok").stdout.decode()}
    kid.close()
print(json.dumps(out))
"""


def test_a_trainer_that_cannot_suspend_filters_forks_a_sandbox(no_leaks):
    """The init's filter denies no call the fork makes, so it needs no suspending."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    # what makes this checkout importable here (PYTHONPATH), then the checkout
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"),
                                         str(Path(__file__).resolve().parents[1])]))
    p = subprocess.run([sys.executable, "-c", _FILTERED_TRAINER], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=path))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.splitlines()[-1])
    assert out == {"suspends": False, "kid": ["bunshin-init", "sleep"], "echo": "ok\n"}
