"""Shared memory, timers and signals across a fork."""

from __future__ import annotations

import os
import signal
import time

import pytest

import bunshin
from bunshin.fork.plan import proc_status
from conftest import fork_one, put, signal_and_read, start_script, wait_file

SHARED = r"""
import mmap, os, signal, sys
anon = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_SHARED)
mfd = os.memfd_create("state")
os.ftruncate(mfd, 1 << 16)
mem = mmap.mmap(mfd, 1 << 16, flags=mmap.MAP_SHARED)
shm_fd = os.open("/dev/shm/seg", os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(shm_fd, 4096)
shm = mmap.mmap(shm_fd, 4096, flags=mmap.MAP_SHARED)
for m in (anon, mem, shm):
    m[:5] = b"start"
pid = os.fork()
role = "child" if pid == 0 else "parent"
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})
open(f"/tmp/ready-{role}", "w").close()
while True:
    sig = signal.sigwait({signal.SIGUSR1, signal.SIGUSR2})
    if sig == signal.SIGUSR1 and role == "parent":   # the writer
        for m in (anon, mem, shm):
            m[:5] = b"wrote"
    elif sig == signal.SIGUSR2:                        # report what this process sees
        with open(f"/tmp/seen-{role}", "w") as f:
            f.write(" ".join(bytes(m[:5]).decode() for m in (anon, mem, shm)))
"""


def _wait(w, cmd, timeout=20):
    deadline = time.monotonic() + timeout
    while not w.run(cmd).ok:
        assert time.monotonic() < deadline, cmd
        time.sleep(0.05)


def _seen(w, pid, role):
    w.run(f"rm -f /tmp/seen-{role}")
    w.kill(pid, 12)
    _wait(w, f"test -s /tmp/seen-{role}")
    return w.read_file(f"/tmp/seen-{role}").decode()


def test_shared_memory_becomes_the_childs_own_copy(no_leaks):
    with bunshin.Workspace.create() as ws:
        ws.write_file("/shared.py", SHARED)
        ws.spawn(["python3", "/shared.py"])
        _wait(ws, "test -e /tmp/ready-parent && test -e /tmp/ready-child")
        procs = {p.cmdline[-1]: p.pid for p in ws.processes() if p.cmdline[:1] == ["python3"]}
        parent, child = sorted(p.pid for p in ws.processes() if p.cmdline[:1] == ["python3"])
        del procs
        (kid,) = ws.fork(1)
        try:
            kid.kill(parent, 10)  # the writer writes in the forked workspace only
            time.sleep(0.3)
            # inside the fork, both of its processes see the write: still shared among them
            assert _seen(kid, child, "child") == "wrote wrote wrote"
            assert _seen(kid, parent, "parent") == "wrote wrote wrote"
            # the source sees none of it: the fork got its own copies
            assert _seen(ws, child, "child") == "start start start"
            assert ws.run("head -c 5 /dev/shm/seg").stdout == b"start"
            assert kid.run("head -c 5 /dev/shm/seg").stdout == b"wrote"
        finally:
            kid.close()


READ_ONLY_MAPS = r"""
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
def ro_shared(fd):  # PROT_READ, MAP_SHARED
    addr = libc.mmap(None, 4096, 1, 1, fd, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    return addr
with open("/data.bin", "wb") as f:
    f.write(b"start".ljust(4096, b"."))
upper_fd = os.open("/data.bin", os.O_RDWR)             # in the upper layer, writable file
shm_fd = os.open("/dev/shm/ro", os.O_RDWR | os.O_CREAT, 0o600)
os.write(shm_fd, b"start".ljust(4096, b"."))
maps = {"lower": ro_shared(os.open("/etc/passwd", os.O_RDONLY)),  # a lower layer's file
        "upper": ro_shared(upper_fd), "shm": ro_shared(shm_fd)}
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})
open("/tmp/ready", "w").close()
while True:
    if signal.sigwait({signal.SIGUSR1, signal.SIGUSR2}) == signal.SIGUSR1:
        # the source's file was opened O_RDWR: it may (the child's remapping may not)
        if libc.mprotect(ctypes.c_void_p(maps["upper"]), 4096, 3) == 0:
            ctypes.memmove(maps["upper"], b"wrote", 5)
        os.pwrite(shm_fd, b"wrote", 0)
    else:
        with open("/tmp/seen-", "w") as f:  # _seen(w, pid, "")
            f.write(" ".join(ctypes.string_at(maps[k], 5).decode() for k in ("lower", "upper", "shm")))
"""


def test_read_only_shared_file_mappings_show_each_sides_own_files(no_leaks):
    """A read-only MAP_SHARED mapping of a lower layer's file is inherited as it is (nothing
    can write that file); one of a workspace-written file or of /dev/shm maps the child's own
    file, so nothing the child writes reaches the source. (A remapped read-only mapping
    cannot be made writable in the child: its file is opened read-only there, as opening it
    for writing would copy it up, at a cost growing with its size.)"""
    with bunshin.Workspace.create() as ws:
        ws.write_file("/ro.py", READ_ONLY_MAPS)
        pid = ws.spawn(["python3", "/ro.py"])
        _wait(ws, "test -e /tmp/ready")
        passwd = ws.read_file("/etc/passwd")[:5].decode()
        (kid,) = ws.fork(1)
        try:
            assert _seen(kid, pid, "") == _seen(ws, pid, "") == f"{passwd} start start"
            kid.kill(pid, 10)  # writes through its (now writable) mapping and into /dev/shm
            time.sleep(0.3)
            assert _seen(kid, pid, "").split()[::2] == [passwd, "wrote"]
            assert _seen(ws, pid, "") == f"{passwd} start start"
            assert ws.read_file("/data.bin")[:5] == b"start"
        finally:
            kid.close()


# PR_SET_MDWE: the process refuses writable+executable memory, so the engine reads its timers
# one call at a time, in memory mapped for the purpose
_MDWE = "import ctypes, sys\nif ctypes.CDLL(None).prctl(65, 1, 0, 0, 0): sys.exit(3)\n"


@pytest.mark.parametrize("mdwe", [False, True], ids=["plain", "no-wx-memory"])
def test_interval_timers_are_rearmed(no_leaks, mdwe):
    with bunshin.Workspace.create() as ws:
        if mdwe and ws.run(f"python3 -c '{_MDWE}'").exit_code:
            pytest.skip("this kernel has no PR_SET_MDWE")
        ws.write_file("/tick.py", (_MDWE if mdwe else "") + "import os, signal, time\nn = 0\n"
                                  "def tick(*_):\n    global n\n    n += 1\n    open('/tmp/ticks.new', 'w').write(str(n))\n"
                                  "    os.replace('/tmp/ticks.new', '/tmp/ticks')\n"
                                  "signal.signal(signal.SIGALRM, tick)\n"
                                  "signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)\n"
                                  "while True: time.sleep(1)\n")
        ws.spawn(["python3", "/tick.py"])
        ws.spawn(["sleep", "1000"])  # no timer: looked at by the first fork only
        _wait(ws, "test -s /tmp/ticks")
        (kid,) = ws.fork(1)
        try:
            a = int(kid.read_file("/tmp/ticks"))
            time.sleep(0.5)
            assert int(kid.read_file("/tmp/ticks")) > a  # fork(2) alone would have dropped the timer
        finally:
            kid.close()
        # every fork of a template re-arms it (the processes without one are looked at once)
        with ws.snapshot() as tpl:
            for _ in range(2):
                (kid,) = tpl.fork(1)
                try:
                    a = int(kid.read_file("/tmp/ticks"))
                    time.sleep(0.3)
                    assert int(kid.read_file("/tmp/ticks")) > a
                finally:
                    kid.close()
            idle = {pl.name: pl.itimers_idle for pl in tpl._core.plans if not pl.is_init}
            assert idle == {"python3": False, "sleep": True}, idle


POSIX_TIMERS = r"""
import ctypes, os, signal, struct, time
lib = ctypes.CDLL(None, use_errno=True)
counts = {signal.SIGUSR1: 0, signal.SIGUSR2: 0}
def on(sig, _):
    counts[sig] += 1
    open("/tmp/counts.new", "w").write(f"{counts[signal.SIGUSR1]} {counts[signal.SIGUSR2]}")
    os.replace("/tmp/counts.new", "/tmp/counts")  # a reader never sees it half-written
signal.signal(signal.SIGUSR1, on)
signal.signal(signal.SIGUSR2, on)
ids = []
for sig, interval_ms in ((0, 0), (signal.SIGUSR1, 50), (signal.SIGUSR2, 70)):  # id 0: a disarmed one
    ev = struct.pack("qiii", 0, sig or signal.SIGUSR1, 0, 0).ljust(64, b"\0")
    tid = ctypes.c_int()
    assert lib.timer_create(1, ev, ctypes.byref(tid)) == 0
    ids.append(tid.value)
    if interval_ms:
        ns = interval_ms * 1_000_000
        its = struct.pack("4q", 0, ns, 0, ns)
        assert lib.timer_settime(tid, 0, its, None) == 0
lib.timer_delete(ids[0])  # leave a hole at id 0
open("/tmp/ids", "w").write(" ".join(map(str, ids[1:])))
while True:
    time.sleep(1)
"""


def test_posix_timers_keep_ids_and_keep_firing(no_leaks):
    with bunshin.Workspace.create() as ws:
        ws.write_file("/pt.py", POSIX_TIMERS)
        pid = ws.spawn(["python3", "/pt.py"])
        _wait(ws, "test -s /tmp/counts")
        (kid,) = ws.fork(1)
        try:
            ids = kid.read_file(f"/proc/{pid}/timers").decode()
            assert ws.read_file(f"/proc/{pid}/timers").decode() == ids  # same ids, signals, clocks
            a = [int(x) for x in kid.read_file("/tmp/counts").split()]
            time.sleep(0.5)
            b = [int(x) for x in kid.read_file("/tmp/counts").split()]
            assert b[0] > a[0] and b[1] > a[1], (a, b)  # both timers fire in the child
        finally:
            kid.close()


SYSV = r"""
import ctypes, signal
lib = ctypes.CDLL(None, use_errno=True)
lib.shmat.restype = ctypes.c_void_p
shmid = lib.shmget(0x1234, 8192, 0o1600)
addr = lib.shmat(shmid, None, 0)
ctypes.memmove(addr, b"start", 5)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})
open("/tmp/ready", "w").write(str(shmid))
while True:
    sig = signal.sigwait({signal.SIGUSR1, signal.SIGUSR2})
    if sig == signal.SIGUSR1:
        ctypes.memmove(addr, b"wrote", 5)
    else:
        open("/tmp/seen", "w").write(ctypes.string_at(addr, 5).decode())
"""


def test_sysv_shm_keeps_its_id_and_becomes_the_childs_own(no_leaks):
    with bunshin.Workspace.create() as ws:
        ws.write_file("/sysv.py", SYSV)
        pid = ws.spawn(["python3", "/sysv.py"])
        _wait(ws, "test -s /tmp/ready")
        shmid = ws.read_file("/tmp/ready").decode()
        mine = os.readlink("/proc/thread-self/ns/ipc")
        (kid,) = ws.fork(1)
        try:
            # the fork read and made the segments from this thread, in the workspaces' IPC
            # namespaces: it is back in its own
            assert os.readlink("/proc/thread-self/ns/ipc") == mine
            seg = kid.run("ipcs -m | grep 0x00001234").stdout.split()
            assert seg[1].decode() == shmid and seg[4] == b"8192"  # same id, key and size
            kid.kill(pid, 10)
            time.sleep(0.2)
            for w, want in ((kid, b"wrote"), (ws, b"start")):
                assert signal_and_read(w, pid, 12, "/tmp/seen") == want
        finally:
            kid.close()


PENDING_SIGNALS = """
import signal, threading
held = {signal.SIGUSR1, signal.SIGUSR2, signal.SIGRTMIN + 3}
signal.pthread_sigmask(signal.SIG_BLOCK, held)
signal.pthread_kill(threading.get_ident(), signal.SIGUSR2)  # the thread's own queue
os.kill(os.getpid(), signal.SIGRTMIN + 3)                   # the process's queue
out('/tmp/ready', '')
wait('/tmp/go')
out('/tmp/out', repr(sorted(int(s) for s in signal.sigpending())))
time.sleep(1000)
"""


def test_blocked_pending_signals_are_pending_in_the_child(family):
    """fork(2) clears pending signals: the engine raises the template's again in the clone,
    process-directed ones (kill) and the thread's own (tgkill) alike."""
    ws = start_script(family, PENDING_SIGNALS, "/tmp/ready")
    pid = next(p.pid for p in ws.processes() if p.cmdline[-1:] == ["/t.py"])
    ws.kill(pid, 10)  # from outside, as the trainer would
    hostpid = next(hp for hp in ws.host_pids() if open(f"/proc/{hp}/cmdline").read().endswith("/t.py\0"))
    deadline = time.monotonic() + 10
    while not int(proc_status(hostpid)["ShdPnd"], 16) & (1 << (10 - 1)):
        assert time.monotonic() < deadline, "SIGUSR1 never became pending"
        time.sleep(0.01)
    kid = fork_one(family, ws)
    for w in (kid, ws):
        put(w, "/tmp/go", "")
        assert wait_file(w, "/tmp/out") == repr([10, 12, int(signal.SIGRTMIN) + 3])
