"""A process running under another uid (a daemon that dropped root, `sudo -u`, a `setpriv`
shell): forked with its ids, groups, capabilities, memory and descriptors. Where the fork's
clones enter the child by their own system calls (a stock kernel), such a process, which may
not, is transplanted (fork/transplant.py): a blank the child's init makes with its pid becomes
it, its memory copied. What a transplant cannot carry is refused up front, naming it."""

from __future__ import annotations

import json
import signal
import time

import pytest
from conftest import fork_one, signal_and_read, start_script, wait_file, wait_for_bytes, ws_status

from bunshin.errors import ForkError
from bunshin.fork.cloners import cloner

# argv[1]: "dropped" gives up root for good (setuid: every uid 1001, no capabilities left);
# "daemon" keeps saved uid 0, as a server that takes root back for a moment (seteuid).
_SCRIPT = r"""
import hashlib, signal, socket
mode = sys.argv[1]
os.makedirs('/run/u', exist_ok=True)
os.chown('/run/u', 1001, 1001)
with open('/run/root-only', 'w') as f:
    f.write('secret')
os.chmod('/run/root-only', 0o600)
log = open('/run/log', 'a', buffering=1)  # opened as root, kept after: a daemon's log
os.chmod('/run/log', 0o600)
kept = open('/run/kept', 'w+')  # a root-only file opened as root, then deleted: in /run,
# which the process cannot write once it runs under 1001 (the trainer makes its copy there)
kept.write('kept by root')
kept.flush()
os.chmod('/run/kept', 0o600)
os.unlink('/run/kept')
# a root helper beside it, sharing a socket pair: the clone under another uid takes its end
# after the helper's clone made the pair (the trainer hands it over)
ours, theirs = socket.socketpair()
if os.fork():
    ours.close()
    while True:
        theirs.send(b'pong ' + theirs.recv(100))
theirs.close()
blob = bytearray(os.urandom(4 << 20))
digest = hashlib.sha256(blob).hexdigest()
os.setgroups([2001, 2002])
if mode == 'dropped':
    os.setgid(1001)
    os.setuid(1001)
else:
    os.setresgid(1001, 1001, 0)
    os.setresuid(1001, 1001, 0)
scratch = open('/tmp/scratch', 'w+')  # its own, deleted: a database's temporary file
scratch.write('own scratch')
scratch.flush()
os.fchmod(scratch.fileno(), 0o640)
os.unlink('/tmp/scratch')

def deleted(f):
    st = os.fstat(f.fileno())
    f.seek(0)
    return [f.read(), st.st_uid, st.st_gid, oct(st.st_mode & 0o7777), st.st_nlink]

def status(key):
    for line in open('/proc/self/status'):
        if line.startswith(key + ':'):
            return line.split(':', 1)[1].strip()

def readable(path):
    try:
        return open(path).read()
    except PermissionError:
        return 'EACCES'

def report(*_):
    blob[0] ^= 1  # its memory is its own (copy-on-write in a child) and still holds the data
    blob[0] ^= 1
    with open('/run/u/mine', 'w') as f:
        f.write(str(os.getpid()))
    log.write('report\n')
    ours.send(b'ping')
    got = {'uid': os.getresuid(), 'gid': os.getresgid(), 'groups': sorted(os.getgroups()),
           'eff': status('CapEff'), 'prm': status('CapPrm'),
           'memory': hashlib.sha256(blob).hexdigest() == digest,
           'owner': os.stat('/run/u/mine').st_uid, 'root-only': readable('/run/root-only'),
           'kept': deleted(kept), 'scratch': deleted(scratch),
           'kept-name': os.readlink(f'/proc/self/fd/{kept.fileno()}'),
           'scratch-name': os.readlink(f'/proc/self/fd/{scratch.fileno()}'),
           'helper': ours.recv(100).decode()}
    if mode == 'daemon':  # root again for a moment, from its saved uid
        os.seteuid(0)
        got['as-root'] = readable('/run/root-only')
        os.seteuid(1001)
    out('/run/u/report', json.dumps(got))

signal.signal(signal.SIGUSR1, report)
out('/run/u/ready', str(os.getpid()))
while True:
    time.sleep(0.05)
"""

_FULL = "000001ffffffffff"

WANT = {
    "dropped": {"uid": [1001, 1001, 1001], "gid": [1001, 1001, 1001], "groups": [2001, 2002],
                "eff": "0000000000000000", "prm": "0000000000000000", "memory": True,
                "owner": 1001, "root-only": "EACCES", "kept": ["kept by root", 0, 0, "0o600", 0],
                "scratch": ["own scratch", 1001, 1001, "0o640", 0],
                "kept-name": "/run/kept (deleted)", "scratch-name": "/tmp/scratch (deleted)",
                "helper": "pong ping"},
    "daemon": {"uid": [1001, 1001, 0], "gid": [1001, 1001, 0], "groups": [2001, 2002],
               "eff": "0000000000000000", "prm": None, "memory": True, "owner": 1001,
               "root-only": "EACCES", "as-root": "secret", "kept": ["kept by root", 0, 0, "0o600", 0],
               "scratch": ["own scratch", 1001, 1001, "0o640", 0],
               "kept-name": "/run/kept (deleted)", "scratch-name": "/tmp/scratch (deleted)",
               "helper": "pong ping"},
}

def fork_both(family, ws, from_tpl: int = 1):
    """A child of ``ws`` by ws.fork() and ``from_tpl`` by a snapshot's fork (the template
    closed at once), all closed with ``family``."""
    kid = fork_one(family, ws)
    tpl = ws.snapshot()
    try:
        kids = tpl.fork(from_tpl)
        family.extend(kids)
    finally:
        tpl.close()
    return kid, kids


def _start(family, mode):
    ws = start_script(family, _SCRIPT, "/run/u/ready", mode)
    return ws, int(ws.read_file("/run/u/ready"))


def _report(w, pid: int) -> dict:
    return json.loads(signal_and_read(w, pid, signal.SIGUSR1, "/run/u/report"))


def _check(w, pid: int, mode: str, prm: str) -> None:
    got = _report(w, pid)
    want = dict(WANT[mode], prm=WANT[mode]["prm"] or prm)
    assert got == want, w.id
    assert ws_status(w, pid, "Uid").split()[:3] == [str(u) for u in want["uid"]]


@pytest.mark.parametrize("mode", ["dropped", "daemon"])
def test_a_process_under_another_uid_keeps_its_ids_and_works_in_the_child(family, mode):
    ws, pid = _start(family, mode)
    prm = ws_status(ws, pid, "CapPrm")  # the daemon's: what it kept of the workspace's set
    assert mode == "dropped" or int(prm, 16)
    _check(ws, pid, mode, prm)
    kid, (from_tpl,) = fork_both(family, ws)
    for w in (ws, kid, from_tpl):
        _check(w, pid, mode, prm)
    for w in (kid, from_tpl):  # the files it wrote are the child's own
        assert w.read_file("/run/u/mine") == str(pid).encode()
        assert w.read_file("/run/log") == b"report\n" * 2
    assert ws.read_file("/run/log") == b"report\n" * 2


# A uid-1001 process holding 64 MiB of a known pattern and a dict, answering on a pipe: its
# memory, ids and layout in every child, and in the source after.
_BIG = r"""
import hashlib, mmap
os.setgroups([2001])
os.setresgid(1001, 1001, 1001)
os.setresuid(1001, 1001, 1001)
blob = bytearray(64 << 20)
for at in range(0, len(blob), 4096):
    blob[at:at + 8] = at.to_bytes(8, 'little')
table = {str(i): i * i for i in range(10000)}
digest = hashlib.sha256(blob).hexdigest()
import ctypes
libc = ctypes.CDLL(None)
assert libc.prctl(41, 1, 0, 0, 0) == 0  # PR_SET_THP_DISABLE: a flag of its memory
os.mkfifo('/tmp/ask', 0o666) if not os.path.exists('/tmp/ask') else None
out('/tmp/ready', str(os.getpid()))
while True:
    with open('/tmp/ask') as f:
        asked = f.read().strip()
    if not asked:
        continue
    got = {'asked': asked, 'pid': os.getpid(), 'uid': os.getresuid(), 'gid': os.getresgid(),
           'groups': os.getgroups(),
           'memory': hashlib.sha256(blob).hexdigest() == digest and table['99'] == 9801,
           'caps': [l.split()[1] for l in open('/proc/self/status') if l.startswith('Cap')],
           'thp_disable': libc.prctl(42, 0, 0, 0, 0)}
    blob[0] ^= 1  # written: copy-on-write, its own
    table[asked] = len(table)
    out('/tmp/answer-' + asked, json.dumps(got))
"""


def _ask(w, word: str) -> dict:
    w.run(f"echo {word} > /tmp/ask")
    return json.loads(wait_file(w, f"/tmp/answer-{word}"))


def _maps(w, pid: int) -> list[str]:
    """/proc/PID/maps without the inode's device (each btrfs snapshot has its own)."""
    out = []
    for line in w.read_file(f"/proc/{pid}/maps").decode().splitlines():
        f = line.split()
        out.append(" ".join(f[:3] + f[5:]))
    return out


def test_a_large_process_under_another_uid_has_its_memory_layout_and_ids_in_each_child(family):
    ws = start_script(family, _BIG, "/tmp/ready")
    pid = int(ws.read_file("/tmp/ready"))
    maps = _maps(ws, pid)
    kid, from_tpl = fork_both(family, ws, 2)
    want = {"pid": pid, "uid": [1001] * 3, "gid": [1001] * 3, "groups": [2001], "memory": True,
            "thp_disable": 1,
            "caps": ["0000000000000000"] * 3 + [ws_status(ws, pid, "CapBnd"), "0000000000000000"]}
    for i, w in enumerate([kid, *from_tpl, ws]):
        assert _maps(w, pid) == maps, w.id
        got = _ask(w, f"w{i}")
        assert got == dict(want, asked=f"w{i}"), w.id
        assert ws_status(w, pid, "Uid").split() == ["1001"] * 4


# a shell started by setpriv (as `su`/`sudo -u` would), its loop forking `sleep` under uid 1001
_SHELL = ("setpriv --reuid=1001 --regid=1001 --clear-groups bash -c "
          "'n=0; while :; do n=$((n+1)); echo $n > /tmp/u/tick; sleep 0.05; done'")


def test_a_shell_started_under_another_uid_keeps_looping_in_each_child(family):
    import bunshin

    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.run("mkdir -p /tmp/u && chown 1001 /tmp/u")
    ws.spawn(["sh", "-c", _SHELL])
    wait_file(ws, "/tmp/u/tick")
    kid, (from_tpl,) = fork_both(family, ws)
    for w in (kid, from_tpl, ws):
        first = int(wait_file(w, "/tmp/u/tick"))
        assert int(wait_for_bytes(w, "/tmp/u/tick", str(first + 3).encode())) >= first + 3, w.id
        assert w.run("stat -c %u /tmp/u/tick").stdout.strip() == b"1001"
        bash = w.run("pgrep -x bash").stdout.split()
        assert bash and all(ws_status(w, int(p), "Uid").split()[0] == "1001" for p in bash)


# a uid-1001 process whose threads each keep a counter going
_THREADED = r"""
import threading
os.setresgid(1001, 1001, 1001)
os.setresuid(1001, 1001, 1001)
counts = [0, 0, 0]
lock = threading.Lock()

def count(i):
    while True:
        with lock:
            counts[i] += 1
        time.sleep(0.01)

for i in range(3):
    threading.Thread(target=count, args=(i,), daemon=True).start()
out('/tmp/ready', str(os.getpid()))
while True:
    time.sleep(0.05)
    ids = [l.split()[1:] for l in open('/proc/self/status') if l[:4] in ('Uid:', 'Gid:')]
    tids = sorted(os.listdir('/proc/self/task'))
    each = {t: [l.split()[1] for l in open(f'/proc/self/task/{t}/status') if l.startswith('Uid:')]
            for t in tids}
    with lock:
        out('/tmp/state', json.dumps({'counts': counts, 'ids': ids, 'tids': tids, 'each': each}))
"""


def test_a_multithreaded_process_under_another_uid_keeps_its_threads_in_each_child(family):
    ws = start_script(family, _THREADED, "/tmp/ready")
    pid = int(ws.read_file("/tmp/ready"))
    tids = json.loads(wait_file(ws, "/tmp/state"))["tids"]
    kid, (from_tpl,) = fork_both(family, ws)
    for w in (kid, from_tpl, ws):
        first = json.loads(wait_file(w, "/tmp/state"))
        time.sleep(0.3)
        now = json.loads(w.read_file("/tmp/state"))
        assert now["tids"] == tids, w.id  # each thread with its tid
        assert all(b > a for a, b in zip(first["counts"], now["counts"])), (w.id, first, now)
        assert now["ids"] == [["1001"] * 4] * 2
        assert all(uid == ["1001"] for uid in now["each"].values()), now["each"]
        assert ws_status(w, pid, "Threads") == "4"


# a uid-1001 process under a seccomp filter of its own: getpgid fails with errno 77
_FILTERED = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
os.setresgid(1001, 1001, 1001)
os.setresuid(1001, 1001, 1001)
libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
code = b''.join(struct.pack("HBBI", *i) for i in [
    (0x20, 0, 0, 0),             # ld nr
    (0x15, 0, 1, 121),           # jeq getpgid
    (0x06, 0, 0, 0x50000 | 77),  # ret ERRNO(77)
    (0x06, 0, 0, 0x7fff0000)])   # ret ALLOW
insns = ctypes.create_string_buffer(code)
prog = ctypes.create_string_buffer(struct.pack("H6xQ", 4, ctypes.addressof(insns)))
assert libc.prctl(22, 2, prog, 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
out('/tmp/ready', str(os.getpid()))
while True:
    time.sleep(0.05)
    got = libc.syscall(121, 0)
    status = {l.split(':')[0]: l.split()[1] for l in open('/proc/self/status')
              if l.startswith(('Seccomp', 'NoNewPrivs', 'Uid'))}
    out('/tmp/state', json.dumps([got, ctypes.get_errno(), status]))
"""


def test_a_process_under_another_uid_keeps_its_seccomp_filter_in_each_child(family):
    ws = start_script(family, _FILTERED, "/tmp/ready")
    own = str(1 + int(ws_status(ws, 1, "Seccomp_filters")))  # and the init's (a sandbox's)
    want = [-1, 77, {"Uid": "1001", "NoNewPrivs": "1", "Seccomp": "2", "Seccomp_filters": own}]
    assert json.loads(wait_file(ws, "/tmp/state")) == want
    kid, (from_tpl,) = fork_both(family, ws)
    for w in (kid, from_tpl, ws):
        w.run("rm -f /tmp/state")
        assert json.loads(wait_file(w, "/tmp/state")) == want, w.id


# a uid-1001 process with a zombie child and a blocked signal pending: its clone waits for
# the zombie's exit code and finds the signal
_ZOMBIE = r"""
import signal
os.setresgid(1001, 1001, 1001)
os.setresuid(1001, 1001, 1001)
z = os.fork()
if z == 0:
    os._exit(7)
time.sleep(0.2)
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
os.kill(os.getpid(), signal.SIGUSR1)
out('/tmp/ready', str(z))
wait('/tmp/go')
pending = sorted(int(s) for s in signal.sigpending())
done, status = os.waitpid(z, 0)
out('/tmp/result', json.dumps([pending, done, os.waitstatus_to_exitcode(status)]))
while True:
    time.sleep(1)
"""


def test_a_process_under_another_uid_keeps_its_zombie_and_pending_signal(family):
    ws = start_script(family, _ZOMBIE, "/tmp/ready")
    z = int(ws.read_file("/tmp/ready"))
    kid = fork_one(family, ws)
    for key in ("State", "Uid", "Gid"):
        assert ws_status(kid, z, key) == ws_status(ws, z, key), key
    for w in (kid, ws):
        w.write_file("/tmp/go", "")
        assert json.loads(wait_file(w, "/tmp/result")) == [[signal.SIGUSR1], z, 7], w.id


entering_by_itself = pytest.mark.skipif(
    not cloner().clone_enters_child, reason="the module's FORK forks such a process by cloning it")

# a uid-1001 process with SysV shared memory attached: its segment is the child's own copy
_SYSV = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
os.setresgid(1001, 1001, 1001)
os.setresuid(1001, 1001, 1001)
shmid = libc.shmget(0, 1 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
at = libc.shmat(shmid, None, 0)
seg = (ctypes.c_char * 16).from_address(at)
seg[:5] = b'first'
out('/tmp/ready', str(os.getpid()))
while True:
    time.sleep(0.05)
    if os.path.exists('/tmp/write'):
        seg[:5] = open('/tmp/write').read().encode()[:5]
    out('/tmp/state', json.dumps([hex(at), seg[:5].decode()]))
"""


def test_a_process_under_another_uid_keeps_its_sysv_segment_as_the_childs_own(family):
    ws = start_script(family, _SYSV, "/tmp/ready")
    at, first = json.loads(wait_file(ws, "/tmp/state"))
    kid, (from_tpl,) = fork_both(family, ws)
    for w in (kid, from_tpl, ws):
        assert json.loads(wait_file(w, "/tmp/state")) == [at, "first"], w.id
        w.write_file("/tmp/write", w.id[:5])
        deadline = time.monotonic() + 10
        while json.loads(w.read_file("/tmp/state"))[1] != w.id[:5] and time.monotonic() < deadline:
            time.sleep(0.02)
    for w in (kid, from_tpl, ws):  # each wrote its own
        assert json.loads(w.read_file("/tmp/state")) == [at, w.id[:5]], w.id


# a uid-1001 process whose second thread alone runs under a seccomp filter (no TSYNC): a
# transplant's threads would all get its main thread's
_THREAD_OWN = r"""
import ctypes, threading
libc = ctypes.CDLL(None, use_errno=True)
allow = ctypes.create_string_buffer(struct.pack("HBBI", 0x06, 0, 0, 0x7fff0000))
prog = ctypes.create_string_buffer(struct.pack("H6xQ", 1, ctypes.addressof(allow)))


def to_uid(uid):  # the calling thread only: raw calls, not glibc's, which set every thread's
    assert libc.syscall(119, uid, uid, uid) == 0 and libc.syscall(117, uid, uid, uid) == 0


def own():
    if KIND == "filter":
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
        assert libc.prctl(22, 2, prog, 0, 0) == 0
    else:
        to_uid(1002)
    while True:
        time.sleep(1)


if KIND == "filter":
    os.setresgid(1001, 1001, 1001)
    os.setresuid(1001, 1001, 1001)
threading.Thread(target=own, daemon=True).start()
time.sleep(0.2)
if KIND == "uid":
    to_uid(1001)
out('/tmp/ready', str(os.getpid()))
while True:
    time.sleep(0.05)
"""


@entering_by_itself
@pytest.mark.parametrize("kind, differ", [("filter", "NoNewPrivs, Seccomp_filters"), ("uid", "Uid, Gid")])
def test_what_a_transplant_cannot_carry_is_refused_up_front_naming_it(family, kind, differ):
    ws = start_script(family, f"KIND = {kind!r}\n" + _THREAD_OWN, "/tmp/ready")
    pid = int(ws.read_file("/tmp/ready"))
    n_dirs = len(list(ws.state_path.parent.iterdir()))
    for make in (lambda: ws.fork(1), ws.snapshot):
        with pytest.raises(ForkError, match=rf"process {pid} \(python3\) runs as uid 1001 without "
                                            r"CAP_SYS_ADMIN and CAP_SYS_CHROOT: .*transplants.*"
                                            rf"threads whose {differ} differ"):
            make()
    assert len(list(ws.state_path.parent.iterdir())) == n_dirs
    assert not ws.cgroup.frozen()
    assert ws_status(ws, pid, "Uid").split()[0] == "1001"


@entering_by_itself
@pytest.mark.parametrize("step", ["_map", "_descriptors", "set_credentials"])
def test_a_transplant_that_fails_midway_leaves_nothing_and_the_source_runs_on(family, monkeypatch,
                                                                               step):
    from bunshin.fork import transplant

    ws, pid = _start(family, "dropped")
    prm = ws_status(ws, pid, "CapPrm")
    n_dirs = len(list(ws.state_path.parent.iterdir()))
    real = getattr(transplant, step)

    def failing(*args, **kw):
        real(*args, **kw)
        raise ForkError(f"injected failure after {step}")

    monkeypatch.setattr(transplant, step, failing)
    with pytest.raises(ForkError, match=f"injected failure after {step}"):
        ws.fork(1)
    monkeypatch.setattr(transplant, step, real)
    assert len(list(ws.state_path.parent.iterdir())) == n_dirs
    assert not ws.cgroup.frozen()
    _check(ws, pid, "dropped", prm)
    kid = fork_one(family, ws)  # and it forks afterwards
    _check(kid, pid, "dropped", prm)


# 64 MiB written by a process as root (cloned: shared copy-on-write) and under uid 1001
# (transplanted: copied); what a fork of each costs, and what its child holds of its own
_HOLDER = r"""
if sys.argv[1] != 'root':
    os.setresgid(1001, 1001, 1001)
    os.setresuid(1001, 1001, 1001)
blob = bytearray(64 << 20)
for at in range(0, len(blob), 4096):
    blob[at] = 1
out('/tmp/ready', str(os.getpid()))
while True:
    time.sleep(1)
"""


def _private_dirty_mib(w, pid: int) -> float:
    text = w.read_file(f"/proc/{pid}/smaps_rollup").decode()
    return sum(int(line.split()[1]) for line in text.splitlines()
               if line.startswith("Private_Dirty:")) / 1024


def test_costs_transplant_vs_clone(family, capsys):
    got = {}
    for who in ("root", "1001"):
        ws = start_script(family, _HOLDER, "/tmp/ready", who)
        pid = int(ws.read_file("/tmp/ready"))
        times = []
        for _ in range(3):
            start = time.perf_counter()
            kid = fork_one(family, ws)
            times.append((time.perf_counter() - start) * 1e3)
        got[who] = (sorted(times)[1], _private_dirty_mib(kid, pid))
    (clone_ms, clone_own), (moved_ms, moved_own) = got["root"], got["1001"]
    assert clone_own < 16, got
    if cloner().clone_enters_child:  # transplanted: its copy is its own (else the module clones it)
        assert moved_own >= 64, got
    with capsys.disabled():
        print(f"\n[transplant costs, 64 MiB written] ws.fork {moved_ms:.1f} ms under uid 1001 "
              f"(transplanted, {moved_own:.0f} MiB of its own) vs {clone_ms:.1f} ms as root "
              f"(cloned, {clone_own:.0f} MiB of its own) (medians of 3)")
