"""A process running under another uid (a daemon that dropped root, `sudo -u`): forked with
its ids, groups and capabilities where the fork's clones are placed in the child by the
kernel (the module's FORK), refused up front, naming it, where each clone must enter the
child by its own system calls (a stock kernel)."""

from __future__ import annotations

import json
import signal

import pytest
from conftest import fork_one, signal_and_read, start_script, ws_status

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

placed_by_kernel = pytest.mark.skipif(
    cloner().clone_enters_child,
    reason=f"clones enter the child by their own system calls here ({cloner().name}): the "
           "module's FORK (kmod/tests/run.sh) places them")
entering_by_itself = pytest.mark.skipif(
    not cloner().clone_enters_child, reason="the module's FORK forks such a process")


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


@placed_by_kernel
@pytest.mark.parametrize("mode", ["dropped", "daemon"])
def test_a_process_under_another_uid_keeps_its_ids_and_works_in_the_child(family, mode):
    ws, pid = _start(family, mode)
    prm = ws_status(ws, pid, "CapPrm")  # the daemon's: what it kept of the workspace's set
    assert mode == "dropped" or int(prm, 16)
    _check(ws, pid, mode, prm)
    kid = fork_one(family, ws)
    tpl = ws.snapshot()
    try:
        (from_tpl,) = tpl.fork(1)
        family.append(from_tpl)
    finally:
        tpl.close()
    for w in (ws, kid, from_tpl):
        _check(w, pid, mode, prm)
    for w in (kid, from_tpl):  # the files it wrote are the child's own
        assert w.read_file("/run/u/mine") == str(pid).encode()
        assert w.read_file("/run/log") == b"report\n" * 2
    assert ws.read_file("/run/log") == b"report\n" * 2


@entering_by_itself
@pytest.mark.parametrize("mode", ["dropped", "daemon"])
def test_a_process_under_another_uid_is_refused_up_front_naming_it(family, mode):
    ws, pid = _start(family, mode)
    prm = ws_status(ws, pid, "CapPrm")
    n_dirs = len(list(ws.state_path.parent.iterdir()))
    with pytest.raises(ForkError, match=rf"process {pid} \(python3\) runs as uid 1001 without "
                                        r"CAP_SYS_ADMIN and CAP_SYS_CHROOT.*module's FORK"):
        ws.fork(1)
    with pytest.raises(ForkError, match=rf"process {pid} \(python3\) runs as uid 1001"):
        ws.snapshot()
    assert len(list(ws.state_path.parent.iterdir())) == n_dirs
    assert not ws.cgroup.frozen()
    _check(ws, pid, mode, prm)
