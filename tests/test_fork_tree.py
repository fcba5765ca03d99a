"""Parent links a fork carries on every kernel: a process's zombies (children it has not waited
for) are made again under its clone with their pids, groups and exit statuses, and its
parent-death signal (PR_SET_PDEATHSIG), each thread's, is set again. The process checks them itself, in each
child and in the source, after ws.fork() and after snapshot() + tpl.fork()."""

from __future__ import annotations

import json
import signal
import time

import pytest

import bunshin
from bunshin.errors import ForkError
from conftest import fork_by, signal_and_read, start_script, wait_file

# Zombies of each kind (an exit code, a signal's default action, SIGKILL, one that left its
# parent's process group), PDEATHSIG on the parent. Its SIGCHLD: counted by a handler (the
# zombies' deaths must not queue another in a clone), or blocked and left pending, or blocked
# and taken (a clone must have none pending then).
_PARENT = r"""
import ctypes, os, signal, sys, time
libc = ctypes.CDLL(None, use_errno=True)
mode = sys.argv[1]
calls = []
if mode == "no-wx-memory":  # PR_SET_MDWE: the engine's calls use memory mapped for them
    libc.prctl(65, 1, 0, 0, 0)
    mode = "handler"
if mode == "handler":
    signal.signal(signal.SIGCHLD, lambda *a: calls.append(1))
else:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
libc.prctl(1, signal.SIGUSR2)  # PR_SET_PDEATHSIG

def child(run):
    pid = os.fork()
    if pid == 0:
        run()
        os._exit(99)
    return pid

def leave_group():
    os.setpgid(0, 0)
    os._exit(6)

zombies = {"exit": child(lambda: os._exit(5)),
           "term": child(lambda: os.kill(os.getpid(), signal.SIGTERM)),
           "kill": child(signal.pause),
           "group": child(leave_group)}
os.kill(zombies["kill"], signal.SIGKILL)
for pid in zombies.values():
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
if mode == "taken":
    signal.sigtimedwait({signal.SIGCHLD}, 1)
time.sleep(0.1)  # the handler runs for the deaths so far
calls.clear()
want = {"exit": (5, None), "term": (None, signal.SIGTERM), "kill": (None, signal.SIGKILL),
        "group": (6, None)}

def state(pid):
    st = open(f"/proc/{pid}/stat").read()
    return st[st.rindex(")") + 2:].split()

def check(*_):
    bad = []
    sig = ctypes.c_int(-1)
    libc.prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
    if sig.value != signal.SIGUSR2:
        bad.append(f"pdeathsig {sig.value}")
    pending = signal.sigpending()
    if pending != ({signal.SIGCHLD} if mode == "pending" else set()):
        bad.append(f"pending {pending}")
    if calls:
        bad.append(f"SIGCHLD handled {len(calls)} times")
    for name, pid in zombies.items():
        fields = state(pid)
        if fields[0] != "Z":
            bad.append(f"{name}: state {fields[0]}")
        group = int(fields[2])
        if group != (pid if name == "group" else os.getpgid(0)):
            bad.append(f"{name}: group {group}")
        got, status = os.waitpid(pid, os.WNOHANG)
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        killed = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        if got != pid or (code, killed) != want[name]:
            bad.append(f"{name}: waitpid {got} {status:#x}")
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG)
        bad.append("a child more")
    except ChildProcessError:
        pass
    out("/tmp/verdict", "PASS" if not bad else "; ".join(bad))

signal.signal(signal.SIGUSR1, check)
out("/tmp/ready", str(os.getpid()))
while True:
    time.sleep(1)
"""

MODES = ["handler", "pending", "taken", "no-wx-memory"]


def _start(family, mode: str):
    if mode == "no-wx-memory":
        probe = bunshin.Workspace.create()
        family.append(probe)
        mdwe = "import ctypes, sys; sys.exit(ctypes.CDLL(None).prctl(65, 1, 0, 0, 0) != 0)"
        if probe.run(f"python3 -c '{mdwe}'").exit_code:
            pytest.skip("this kernel has no PR_SET_MDWE")
    ws = start_script(family, _PARENT, "/tmp/ready", mode)
    return ws, int(ws.read_file("/tmp/ready"))


def _verdict(w, pid: int) -> str:
    return signal_and_read(w, pid, signal.SIGUSR1, "/tmp/verdict").decode()


def _zombies(w) -> int:
    return w.run("ps -o stat= -e").stdout.count(b"Z")


def _check_zombies(ws, pid: int, kids) -> None:
    """The process's own verdict in each child, with its four zombies, then in the source."""
    for k in kids:
        assert _zombies(k) == 4
        assert _verdict(k, pid) == "PASS"
    assert _verdict(ws, pid) == "PASS"


@pytest.mark.parametrize("mode", MODES)
def test_zombies_and_pdeathsig_are_carried_by_a_fork(family, mode):
    ws, pid = _start(family, mode)
    before = ws.host_pids()
    kids = ws.fork(2)
    family.extend(kids)
    assert ws.host_pids() == before
    _check_zombies(ws, pid, kids)


@pytest.mark.parametrize("mode", MODES)
def test_zombies_and_pdeathsig_are_carried_by_a_template(family, mode):
    ws, pid = _start(family, mode)
    tpl = ws.snapshot()
    try:
        kids = tpl.fork(2)
        family.extend(kids)
        more = tpl.fork(1)  # a held template's second fork
        family.extend(more)
    finally:
        tpl.close()
    _check_zombies(ws, pid, kids + more)


# Threads with parent-death signals of their own (SIGUSR1 for thread 1, none for thread 2, the
# main thread's SIGUSR2), each counting; /tmp/threads says what each has and its count.
_THREADS = r"""
import ctypes, signal, threading, time
libc = ctypes.CDLL(None)
libc.prctl(1, signal.SIGUSR2)  # PR_SET_PDEATHSIG
counts = [0, 0]

def pdeathsig():
    sig = ctypes.c_int(-1)
    libc.prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
    return sig.value

def count(i, sig):
    if sig:
        libc.prctl(1, sig)
    while True:
        counts[i] += 1
        out(f"/tmp/thread{i}", json.dumps([pdeathsig(), counts[i]]))
        time.sleep(0.02)

for i, sig in enumerate([signal.SIGUSR1, 0]):
    threading.Thread(target=count, args=(i, sig), daemon=True).start()
while not all(os.path.exists(f"/tmp/thread{i}") for i in range(2)):
    time.sleep(0.01)
out("/tmp/ready", str(os.getpid()))
while True:
    out("/tmp/main", str(pdeathsig()))
    time.sleep(0.05)
"""


def _threads_go_on(w, pid: int) -> None:
    """Once SIGCONT resumes the stopped process, each thread counts on with its own signal."""
    for i in range(2):
        w.run(f"rm -f /tmp/thread{i}")
    w.kill(pid, signal.SIGCONT)
    for i, sig in enumerate([signal.SIGUSR1, 0]):
        got, n = json.loads(wait_file(w, f"/tmp/thread{i}"))
        assert got == sig, (w.id, i)
        deadline = time.monotonic() + 10
        while json.loads(w.read_file(f"/tmp/thread{i}"))[1] < n + 3:
            assert time.monotonic() < deadline, (w.id, f"thread {i} stays stopped")
            time.sleep(0.02)
    w.run("rm -f /tmp/main")
    assert wait_file(w, "/tmp/main") == str(int(signal.SIGUSR2))


@pytest.mark.parametrize("path", ["ws_fork", "tpl_fork"])
def test_each_threads_pdeathsig_is_carried_and_a_stopped_process_goes_on(family, path):
    """A thread's parent-death signal is its own, read and set in that thread: of a process
    stopped by a signal too, whose threads SIGCONT resumes in the child as in the source."""
    ws = start_script(family, _THREADS, "/tmp/ready")
    pid = int(ws.read_file("/tmp/ready"))
    ws.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while ws.run(f"grep -q '^State:.T' /proc/{pid}/status").exit_code:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    kid = fork_by(ws, path)
    family.append(kid)
    for w in (kid, ws):
        _threads_go_on(w, pid)


# A zombie a clone cannot have: one made by clone() with another exit signal, and one whose
# parent has since set SIGCHLD to SIG_IGN (the kernel would reap its clone's at once).
_REFUSED = r"""
import ctypes, os, signal, sys, time
libc = ctypes.CDLL(None, use_errno=True)
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
if sys.argv[1] == "exit-signal":
    pid = libc.syscall(56, int(signal.SIGUSR1), 0, 0, 0, 0)  # clone(exit signal SIGUSR1)
    if pid == 0:
        os._exit(3)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | 0x40000000)  # __WALL
else:
    pid = os.fork()
    if pid == 0:
        os._exit(3)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
out("/tmp/ready", str(pid))
while True:
    time.sleep(1)
"""


@pytest.mark.parametrize("why, says", [("exit-signal", "exit signal 10"), ("ignored", "ignores SIGCHLD")])
def test_a_zombie_a_clone_cannot_have_is_refused(family, why, says):
    ws = start_script(family, _REFUSED, "/tmp/ready", why)
    zombie = int(ws.read_file("/tmp/ready"))
    before = ws.host_pids()
    with pytest.raises(ForkError, match=rf"zombie child {zombie}\b.*{says}"):
        ws.fork(1)
    with pytest.raises(ForkError, match=f"zombie child {zombie}"):
        ws.snapshot()
    assert ws.host_pids() == before
    assert "Z" in ws.run(f"ps -o stat= -p {zombie}").stdout.decode()
    assert ws.run("echo on").stdout == b"on\n"


# A shell's jobs in an exact tree (fork/tree.py, the default): job 1 holds 64 MiB of
# its own and exits 7 once /tmp/go exists, job 2 sleeps. A child's shell waits for them as the
# source's does, and job 1 is made from the source's pages (copy-on-write), the shell alone
# copied.
_BIG = """
import os, sys, time
b = bytearray(b"x" * (64 << 20))
open("/tmp/big.ready", "w").close()
while not os.path.exists("/tmp/go"):
    time.sleep(0.05)
sys.exit(7)
"""


def _shell_with_jobs(family, monkeypatch):
    monkeypatch.setenv("BUNSHIN_TREE", "exact")
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.write_file("/big.py", _BIG)
    sh = ws.shell()
    sh.run("python3 /big.py &")
    sh.run("sleep 300 &")
    wait_file(ws, "/tmp/big.ready")
    return ws, sh


def _private_dirty(sh, pid: bytes) -> int:
    out = sh.run(f"grep Private_Dirty /proc/{pid.decode()}/smaps_rollup").stdout.split()
    return int(out[1]) << 10


def _check_jobs(sh, copied: bool) -> None:
    assert sh.run("jobs").stdout.count(b"Running") == 2
    big, sleeper = sh.run("jobs -p").stdout.split()
    me = sh.run("echo $$").stdout.strip()
    for job in (big, sleeper):
        assert sh.run(f"ps -o ppid= -p {job.decode()}").stdout.strip() == me
    if copied:  # the job's pages are still the source's (a shell's clone copies its own alone)
        assert _private_dirty(sh, big) < 16 << 20
    assert sh.run("touch /tmp/go; wait %1; echo $?").stdout.strip().endswith(b"7")
    assert sh.run("kill %2; wait; echo $?").stdout.strip().endswith(b"0")
    assert sh.run(f"ps -o pid= -p {sleeper.decode()} || echo gone").stdout.strip() == b"gone"
    assert sh.run("jobs").stdout.strip() == b""


def _check_jobs_everywhere(ws, sh, kids) -> None:
    """The jobs of each child's shell, then of the source's, each waited for there."""
    for k in kids:
        _check_jobs(k.shells[0], copied=True)
    ws.run("rm -f /tmp/go")
    _check_jobs(sh, copied=False)


def test_a_shells_jobs_are_its_children_in_a_fork(family, monkeypatch):
    ws, sh = _shell_with_jobs(family, monkeypatch)
    before = ws.host_pids()
    kids = ws.fork(2)
    family.extend(kids)
    assert ws.host_pids() == before
    _check_jobs_everywhere(ws, sh, kids)


def test_a_shells_jobs_are_its_children_in_a_templates_fork(family, monkeypatch):
    ws, sh = _shell_with_jobs(family, monkeypatch)
    tpl = ws.snapshot()
    try:
        kids = tpl.fork(2)
        family.extend(kids)
    finally:
        tpl.close()
    _check_jobs_everywhere(ws, sh, kids)


def test_a_flat_tree_is_there_for_the_asking(family, monkeypatch):
    """BUNSHIN_TREE=flat: every clone a child of the child's init (no parent copied), the
    source's own tree untouched."""
    ws, sh = _shell_with_jobs(family, monkeypatch)
    monkeypatch.setenv("BUNSHIN_TREE", "flat")
    (kid,) = ws.fork(1)
    family.append(kid)
    big, sleeper = kid.shells[0].run("jobs -p").stdout.split()
    for job in (big, sleeper):
        assert kid.run(f"ps -o ppid= -p {job.decode()}").stdout.strip() == b"1"
    _check_jobs(sh, copied=False)


def test_a_parents_clone_keeps_none_of_its_heirs_own_settings(family, monkeypatch):
    """A shell's clone is first a copy of its biggest job (its heir): what that job set for
    itself alone (THP off, PR_SET_THP_DISABLE) is not the shell's in the child."""
    monkeypatch.setenv("BUNSHIN_TREE", "exact")
    ws = bunshin.Workspace.create()
    family.append(ws)
    sh = ws.shell()
    sh.run("python3 -c 'import ctypes, time; ctypes.CDLL(None).prctl(41, 1, 0, 0, 0); "
           "b = bytearray(32 << 20); open(\"/tmp/ready\", \"w\").close(); time.sleep(600)' &")
    wait_file(ws, "/tmp/ready")

    def thp(w):
        job = w.shells[0].run("jobs -p").stdout.split()[0].decode()
        me = w.shells[0].run("echo $$").stdout.strip().decode()
        return {who: w.run(f"grep THP_enabled /proc/{pid}/status").stdout.split()[1]
                for who, pid in (("shell", me), ("job", job))}

    assert thp(ws) == {"shell": b"1", "job": b"0"}
    (kid,) = ws.fork(1)
    family.append(kid)
    assert thp(kid) == {"shell": b"1", "job": b"0"}


_NOTIFY = r"""
import ctypes, struct, time
libc = ctypes.CDLL(None, use_errno=True)
# syscall 999 goes to a listener (closed at once: the filter stays), everything else is allowed
code = b"".join(struct.pack("HBBI", *i) for i in (
    (0x20, 0, 0, 0), (0x15, 0, 1, 999), (0x06, 0, 0, 0x7fc00000), (0x06, 0, 0, 0x7fff0000)))
buf = ctypes.create_string_buffer(code)
prog = ctypes.create_string_buffer(struct.pack("H6xQ", 4, ctypes.addressof(buf)))
fd = libc.syscall(317, 1, 8, prog)  # seccomp(SET_MODE_FILTER, FLAG_NEW_LISTENER)
assert fd >= 0, ctypes.get_errno()
os.close(fd)
open("/tmp/notify.ready", "w").close()
time.sleep(600)
"""


def test_a_job_whose_filter_a_transplant_cannot_have_is_cloned_flat(family, monkeypatch):
    """A job that is not the shell's heir is copied by a transplant in its parent's clone,
    unless its seccomp filters could not be had again (one hands calls to a listener): then it
    is cloned as a child of the child's init, and the fork goes through."""
    monkeypatch.setenv("BUNSHIN_TREE", "exact")
    ws, sh = _shell_with_jobs(family, monkeypatch)
    ws.write_file("/notify.py", "import os\n" + _NOTIFY)
    sh.run("python3 /notify.py &")
    wait_file(ws, "/tmp/notify.ready")
    job = sh.run("jobs -p").stdout.split()[-1].decode()
    (kid,) = ws.fork(1)
    family.append(kid)
    # its own filter on top of those it inherited from the init (a sandbox's init has one)
    inherited = int(ws.run("grep Seccomp_filters /proc/1/status").stdout.split()[1])
    for w in (kid, ws):
        assert int(w.run(f"grep Seccomp_filters /proc/{job}/status").stdout.split()[1]) == inherited + 1
    assert kid.run(f"ps -o ppid= -p {job}").stdout.strip() == b"1"
    big = sh.run("jobs -p").stdout.split()[0].decode()
    assert kid.run(f"ps -o ppid= -p {big}").stdout.strip() == sh.run("echo $$").stdout.strip()
