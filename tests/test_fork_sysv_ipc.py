"""SysV semaphore sets and message queues across a fork: each child gets its own, with the same
ids, keys, owners, values and messages; a process that used SEM_UNDO is refused."""

from __future__ import annotations

import json
import os

import pytest

from bunshin.errors import ForkError
from conftest import fork_one, start_script, wait_file

IPC = r"""
import ctypes, errno, signal
lib = ctypes.CDLL(None, use_errno=True)
lib.msgrcv.restype = ctypes.c_ssize_t
lib.msgrcv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long, ctypes.c_int]
lib.msgsnd.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
IPC_CREAT, IPC_NOWAIT, IPC_SET, IPC_STAT = 0o1000, 0o4000, 1, 2
GETPID, GETALL, SETALL = 11, 13, 17

class Perm(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int if n == "key" else ctypes.c_uint) for n in
                ("key", "uid", "gid", "cuid", "cgid", "mode")] + [("seq", ctypes.c_ulong), ("u", ctypes.c_ulong * 2)]
class SemDs(ctypes.Structure):
    _fields_ = [("perm", Perm), ("t", ctypes.c_long * 4), ("nsems", ctypes.c_ulong), ("u", ctypes.c_ulong * 2)]
class MsgDs(ctypes.Structure):
    _fields_ = [("perm", Perm), ("t", ctypes.c_long * 3), ("cbytes", ctypes.c_ulong), ("qnum", ctypes.c_ulong),
                ("qbytes", ctypes.c_ulong), ("lspid", ctypes.c_int), ("lrpid", ctypes.c_int), ("u", ctypes.c_ulong * 2)]

def ok(r):
    if r < 0:
        raise OSError(ctypes.get_errno(), "ipc")
    return r

def semop(semid, num, op):
    b = (ctypes.c_short * 3)(num, op, 0)
    ok(lib.semop(semid, b, 1))

def send(qid, mtype, text):
    b = ctypes.create_string_buffer(mtype.to_bytes(8, "little") + text)
    ok(lib.msgsnd(qid, b, len(text), IPC_NOWAIT))

def perm(p):
    return [p.key, p.uid, p.gid, p.cuid, p.cgid, p.mode & 0o777]

# a set made by another user (cuid/cgid), another owned by someone else than its maker
os.setegid(4321); os.seteuid(1234)
theirs = ok(lib.semget(0x5152, 1, IPC_CREAT | 0o666))
os.seteuid(0); os.setegid(0)
sem = ok(lib.semget(0x5151, 3, IPC_CREAT | 0o640))
ok(lib.semctl(sem, 0, SETALL, (ctypes.c_ushort * 3)(2, 0, 7)))
semop(sem, 0, 1)  # 3, 0, 7; every semaphore's last operator is this process
ds = SemDs(); ok(lib.semctl(sem, 0, IPC_STAT, ctypes.byref(ds)))
ds.perm.uid, ds.perm.gid = 1000, 1001
ok(lib.semctl(sem, 0, IPC_SET, ctypes.byref(ds)))
priv = ok(lib.semget(0, 2, 0o600))  # IPC_PRIVATE
if (helper := os.fork()) == 0:  # the last operator of priv[1], alive at the fork
    semop(priv, 1, 1)
    time.sleep(1000)
if (dead := os.fork()) == 0:  # the last operator of priv[0], gone before the fork
    semop(priv, 0, 1)
    os._exit(0)
os.waitpid(dead, 0)
while lib.semctl(priv, 1, GETPID) != helper:
    time.sleep(0.01)
semop(theirs, 0, 5)

q = ok(lib.msgget(0x6161, IPC_CREAT | 0o620))
for mtype, text in ((1, b"one"), (5, b"\x00five\xff"), (2, b"two" * 100), (1, b"")):
    send(q, mtype, text)
md = MsgDs(); ok(lib.msgctl(q, IPC_STAT, ctypes.byref(md)))
md.qbytes = 300  # below what it holds (309 bytes): no more can be sent
ok(lib.msgctl(q, IPC_SET, ctypes.byref(md)))
empty = ok(lib.msgget(0x6162, IPC_CREAT | 0o600))
open("/proc/sys/kernel/msgmax", "w").write("20000")  # the namespace's limit, kept by its children
big = ok(lib.msgget(0x6163, IPC_CREAT | 0o600))
send(big, 3, bytes(range(256)) * 50)

def report():
    sets = {}
    for s in (sem, theirs, priv):
        d = SemDs(); ok(lib.semctl(s, 0, IPC_STAT, ctypes.byref(d)))
        vals = (ctypes.c_ushort * d.nsems)(); ok(lib.semctl(s, 0, GETALL, vals))
        pids = [lib.semctl(s, i, GETPID) for i in range(d.nsems)]
        sets[s] = [perm(d.perm), list(vals), pids]
    queues = {}
    for m in (q, empty, big):
        d = MsgDs(); ok(lib.msgctl(m, IPC_STAT, ctypes.byref(d)))
        got = []
        buf = ctypes.create_string_buffer(8 + 20000)
        while (n := lib.msgrcv(m, buf, 20000, 0, IPC_NOWAIT)) >= 0:  # takes them: each side its own
            got.append([int.from_bytes(buf.raw[:8], "little"), buf.raw[8:8 + n].hex()])
        queues[m] = [perm(d.perm), d.qbytes, d.qnum, got]
    send(q, 9, b"again")  # for the next report (the queue is empty now)
    send(big, 3, bytes(range(256)) * 50)
    return {"me": os.getpid(), "helper": helper, "dead": dead, "sets": sets, "queues": queues}

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
out("/tmp/ready", json.dumps(report()))
while True:
    signal.sigwait({signal.SIGUSR1})
    out("/tmp/report", json.dumps(report()))
"""


def ask(w) -> dict:
    w.run("rm -f /tmp/report")
    pid = json.loads(w.read_file("/tmp/ready"))["me"]
    w.kill(pid, 10)
    return json.loads(wait_file(w, "/tmp/report"))


def test_semaphores_and_message_queues_keep_ids_owners_values_and_messages(family):
    ws = start_script(family, "import json\n" + IPC, "/tmp/ready")
    first = json.loads(ws.read_file("/tmp/ready"))
    me = first["me"]
    sets, queues = first["sets"], first["queues"]
    sem, theirs, priv = sets
    q, empty, big = queues
    assert sets[sem] == [[0x5151, 1000, 1001, 0, 0, 0o640], [3, 0, 7], [me] * 3]
    assert sets[theirs] == [[0x5152, 1234, 4321, 1234, 4321, 0o666], [5], [me]]
    assert sets[priv] == [[0, 0, 0, 0, 0, 0o600], [1, 1], [first["dead"], first["helper"]]]
    msgs = [[1, b"one".hex()], [5, b"\x00five\xff".hex()], [2, (b"two" * 100).hex()], [1, ""]]
    assert queues[q] == [[0x6161, 0, 0, 0, 0, 0o620], 300, 4, msgs]
    assert queues[empty] == [[0x6162, 0, 0, 0, 0, 0o600], 16384, 0, []]
    assert queues[big] == [[0x6163, 0, 0, 0, 0, 0o600], 16384, 1, [[3, (bytes(range(256)) * 50).hex()]]]
    # what each side holds from now on: the first report took the messages and sent one
    # a last operator that is no process of the template is none in its children
    after = {q: [queues[q][0], 300, 1, [[9, b"again".hex()]]], empty: queues[empty], big: queues[big]}
    want_source = dict(first, queues=after)  # the source keeps its own, the dead operator too
    want = dict(first, sets=dict(sets, **{priv: [sets[priv][0], [1, 1], [0, first["helper"]]]}), queues=after)
    mine = os.readlink("/proc/thread-self/ns/ipc")

    kid = fork_one(family, ws)
    assert os.readlink("/proc/thread-self/ns/ipc") == mine
    assert ask(kid) == want
    assert ask(ws) == want_source  # the child took its own copy of the messages, not the source's

    tpl = ws.snapshot()
    try:
        kids = tpl.fork(2)
        family.extend(kids)
        for k in kids:
            assert ask(k) == want
    finally:
        tpl.close()
    assert ask(ws) == want_source


WAITERS = r"""
import ctypes, errno
lib = ctypes.CDLL(None, use_errno=True)
lib.msgrcv.restype = ctypes.c_ssize_t
lib.msgrcv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long, ctypes.c_int]
sem = lib.semget(0x7171, 1, 0o1600)
q = lib.msgget(0x7272, 0o1600)
if os.fork() == 0:
    buf = ctypes.create_string_buffer(64)
    out("/tmp/rcv-waiting", "")
    while (n := lib.msgrcv(q, buf, 56, 7, 0)) < 0:  # the kernel restarts it after the freeze
        assert ctypes.get_errno() == errno.EINTR
    out("/tmp/got-msg", buf.raw[8:8 + n].decode())
    os._exit(0)
wait("/tmp/rcv-waiting")
out("/tmp/ready", "")
op = (ctypes.c_short * 3)(0, -1, 0)
while lib.semop(sem, op, 1) < 0:  # never restarted after a stop (signal(7)): the freeze fails it
    assert ctypes.get_errno() == errno.EINTR
out("/tmp/got-sem", "")
time.sleep(1000)
"""

POST = r"""
import ctypes
lib = ctypes.CDLL(None, use_errno=True)
assert lib.semop(lib.semget(0x7171, 1, 0), (ctypes.c_short * 3)(0, 1, 0), 1) == 0
b = ctypes.create_string_buffer((7).to_bytes(8, "little") + b"seven")
assert lib.msgsnd(lib.msgget(0x7272, 0), b, 5, 0) == 0
"""


def test_blocked_semop_and_msgrcv_wait_on_in_the_child(family):
    """A process blocked in semop or msgrcv when the workspace is forked waits on, in the child
    on the child's own set and queue: a post there wakes it, and only it. The snapshot's freeze
    makes a waiting semop fail with EINTR once, in the source and in every child alike (the
    kernel never restarts semop after a stop); msgrcv is restarted."""
    ws = start_script(family, WAITERS, "/tmp/ready")
    kid = fork_one(family, ws)
    for w in (kid, ws):
        assert w.run("sleep 0.3; ls /tmp/got-sem /tmp/got-msg 2>/dev/null").stdout == b""
    kid.write_file("/post.py", POST)
    assert kid.run("python3 /post.py").exit_code == 0
    assert wait_file(kid, "/tmp/got-msg") == "seven"
    wait_file(kid, "/tmp/got-sem")
    assert ws.run("sleep 0.3; ls /tmp/got-sem /tmp/got-msg 2>/dev/null").stdout == b""
    ws.write_file("/post.py", POST)
    assert ws.run("python3 /post.py").exit_code == 0
    assert wait_file(ws, "/tmp/got-msg") == "seven"
    wait_file(ws, "/tmp/got-sem")


UNDO = r"""
import ctypes
lib = ctypes.CDLL(None)
sem = lib.semget(0, 1, 0o600)
lib.semop(sem, (ctypes.c_short * 3)(0, 1, 0), 1)  # no SEM_UNDO: carried
if os.fork() == 0:
    lib.semop(sem, (ctypes.c_short * 3)(0, 1, 0x1000), 1)  # SEM_UNDO
    out("/tmp/undo", "")
    time.sleep(1000)
wait("/tmp/undo")
out("/tmp/ready", "")
time.sleep(1000)
"""


def test_a_process_with_undo_adjustments_is_refused_by_name(family):
    ws = start_script(family, UNDO, "/tmp/ready")
    undoer = max(p.pid for p in ws.processes() if p.cmdline[-1:] == ["/t.py"])
    mine = os.readlink("/proc/thread-self/ns/ipc")
    with pytest.raises(ForkError, match=f"process {undoer} \\(python3\\) has used SEM_UNDO"):
        ws.fork(1)
    assert os.readlink("/proc/thread-self/ns/ipc") == mine
    assert ws.run("echo alive").stdout == b"alive\n"
