"""Batches (many injected system calls in one stop) against real victims: the calls' effects
are checked in the victim (/proc, files it wrote), and the victim carries on unharmed after.

The same batch runs through Tracee.batch (compel) and through Remote's queue (the fork
engine's use of it).
"""

from __future__ import annotations

import errno
import mmap
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from test_compel import (Procs, bins, procs, readline, status, thread_counts, tracers,  # noqa: F401
                          wait_syscall)

from bunshin.compel import SYS_exit_group, SYS_getpid, Tracee
from bunshin.errors import ForkError
from bunshin.fork.remote import Remote

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ptrace of other processes needs root")

SYS_write, SYS_close, SYS_openat, SYS_dup3, SYS_ppoll = 1, 3, 257, 292, 271
AT_FDCWD = -100 & 0xFFFFFFFFFFFFFFFF
RWX = mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC
REF = Tracee.batch_ref
SIGUSR1 = int(signal.SIGUSR1)


class Page:
    """Scratch memory in the victim: the blob at the start, the table after it, data in the
    second page."""

    def __init__(self, t: Tracee) -> None:
        self.t = t
        self.addr = t.mmap(2 * 4096, RWX)
        self.data = self.addr + 4096

    def run(self, calls):
        return self.t.batch(self.addr, self.addr + 128, calls)

    def put(self, off: int, raw: bytes) -> int:
        self.t.write(self.data + off, raw)
        return self.data + off


def fds(pid: int) -> set[int]:
    return {int(x) for x in os.listdir(f"/proc/{pid}/fd")}


def test_references_and_real_effects(procs, bins, tmp_path):
    p, _ = procs.start([bins / "sleeper", "1.0"])
    wait_syscall(p.pid)
    out = tmp_path / "written-by-victim"
    msg = b"hello from a batch\n"
    with Tracee.seize(p.pid) as t:
        pg = Page(t)
        path, text = pg.put(0, os.fsencode(out) + b"\0"), pg.put(512, msg)
        rets = pg.run([
            (SYS_getpid, (), 0),
            (SYS_openat, (AT_FDCWD, path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600), 0),
            (SYS_dup3, (1, 100, os.O_CLOEXEC), REF(0)),  # entry 1's fd becomes 100
            (SYS_write, (2, text, len(msg)), REF(0)),    # through 100, entry 2's result
            (SYS_close, (1,), REF(0)),
        ])
        fd = rets[1]
        assert rets == [p.pid, fd, 100, len(msg), 0]
        assert 100 in fds(p.pid) and fd not in fds(p.pid)
        assert os.readlink(f"/proc/{p.pid}/fd/100") == str(out)
        assert out.read_bytes() == msg
        assert t.syscall(SYS_close, 100) == 0  # a single call after a batch
        assert 100 not in fds(p.pid)
        assert pg.run([(SYS_getpid, (), 0)] * 3) == [p.pid] * 3  # and a batch after it
        t.munmap(pg.addr, 2 * 4096)
    assert tracers(p.pid) == {0}
    res = readline(p, 5).split()
    assert res[0] == "slept" and res[2] == "eintr=0", res  # nanosleep restarted, no EINTR
    assert 1000 <= int(res[1]) < 1500
    assert p.wait(5) == 0


def test_stops_at_first_error_unless_allowed(procs, bins, tmp_path):
    p, _ = procs.start([bins / "sleeper", "1.0"])
    wait_syscall(p.pid)
    never = tmp_path / "never"
    with Tracee.seize(p.pid) as t:
        pg = Page(t)
        path = pg.put(0, os.fsencode(never) + b"\0")
        create = (SYS_openat, (AT_FDCWD, path, os.O_CREAT | os.O_WRONLY, 0o600), 0)
        # the failing call is the last that ran: nothing after it
        assert pg.run([(SYS_getpid, (), 0), (SYS_close, (999,), 0), create]) == [p.pid, -errno.EBADF]
        assert not never.exists()
        # the one errno allowed goes on; another stops
        assert pg.run([(SYS_close, (999,), Tracee.batch_ok_errno(errno.EBADF)),
                       (SYS_getpid, (), 0)]) == [-errno.EBADF, p.pid]
        assert pg.run([(SYS_close, (999,), Tracee.batch_ok_errno(errno.ENOENT)),
                       (SYS_getpid, (), 0)]) == [-errno.EBADF]
        assert pg.run([(SYS_close, (999,), Tracee.BATCH_OK_ERR),
                       (SYS_getpid, (), 0)]) == [-errno.EBADF, p.pid]
        # a reference to a later call is refused before anything runs
        with pytest.raises(ForkError) as ei:
            pg.run([(SYS_close, (1,), REF(0)), create])
        assert ei.value.errno == errno.EINVAL and ei.value.step == "batch"
        assert not never.exists()
        assert t.syscall(SYS_getpid) == p.pid
    res = readline(p, 5).split()
    assert res[0] == "slept" and res[2] == "eintr=0", res
    assert p.wait(5) == 0


def test_signal_during_batch_is_held_and_delivered_after(procs, bins):
    p, _ = procs.start([bins / "sleeper", "1.5"])
    wait_syscall(p.pid)
    with Tracee.seize(p.pid) as t:
        pg = Page(t)
        ts = pg.put(0, (0).to_bytes(8, "little") + (400_000_000).to_bytes(8, "little"))
        threading.Timer(0.1, os.kill, (p.pid, signal.SIGUSR1)).start()
        t0 = time.monotonic()
        rets = pg.run([(SYS_getpid, (), 0), (SYS_ppoll, (0, 0, ts, 0, 8), 0), (SYS_getpid, (), 0)])
        assert rets == [p.pid, 0, p.pid]  # ppoll restarted inside the blob after the held signal
        assert time.monotonic() - t0 >= 0.35
        assert t.held_signals() == [SIGUSR1]
        # cure re-queues it from the blob's int3 stop (the page stays: the victim ignores it)
    assert readline(p, 5) == f"usr1 from {os.getpid()}"  # sender's siginfo kept
    res = readline(p, 5).split()
    assert res[0] == "slept" and res[2] == "eintr=1", res
    assert p.wait(5) == 0


def test_bash_in_read_and_python_in_user_code_carry_on(procs):
    p, _ = procs.start(["bash", "-c", "echo ready; read x; echo got:$x"], stdin=subprocess.PIPE)
    wait_syscall(p.pid)
    with Tracee.seize(p.pid) as t:
        assert t.thread_state().in_syscall
        pg = Page(t)
        assert pg.run([(SYS_getpid, (), 0)] * 4) == [p.pid] * 4
        assert t.syscall(SYS_getpid) == p.pid
        assert pg.run([(SYS_getpid, (), 0)]) == [p.pid]  # ends the injections with a batch
    p.stdin.write("hello\n")
    p.stdin.flush()
    assert readline(p, 5) == "got:hello"  # read() restarted and got the line
    assert p.wait(5) == 0

    n = 20_000_000
    code = f"print('ready', flush=True)\ns = 0\nfor i in range({n}): s += i\nprint(s)"
    p, _ = procs.start([sys.executable, "-c", code])
    time.sleep(0.3)
    with Tracee.seize(p.pid) as t:
        assert not t.thread_state().in_syscall
        pg = Page(t)
        assert pg.run([(SYS_getpid, (), 0)] * 4) == [p.pid] * 4
    assert int(readline(p, 30)) == n * (n - 1) // 2
    assert p.wait(5) == 0


def test_batch_with_every_thread_stopped(procs, bins):
    n = 4
    p, line = procs.start([bins / "threads", str(n)])
    counters = int(line.split()[2], 16)

    def counts(t):
        return thread_counts(t, counters, n)

    with Tracee.seize(p.pid) as t:
        t.stop_all()
        before = counts(t)
        assert Page(t).run([(SYS_getpid, (), 0)] * 5) == [p.pid] * 5
        assert counts(t) == before  # the others stayed stopped while the blob ran
    time.sleep(0.3)
    with Tracee.seize(p.pid) as t:
        after = counts(t)
    assert all(a > b for a, b in zip(after, before)), (before, after)


def test_victim_exits_mid_batch(procs, bins):
    p, _ = procs.start([bins / "sleeper", "10"])
    wait_syscall(p.pid)
    t = Tracee.seize(p.pid)
    pg = Page(t)
    with pytest.raises(ForkError) as ei:
        pg.run([(SYS_getpid, (), 0), (SYS_exit_group, (3,), 0), (SYS_getpid, (), 0)])
    assert ei.value.pid == p.pid
    assert not t.alive
    t.detach()  # nothing left to detach from: must not raise or hang
    assert p.wait(5) == 3


def test_remote_queue(procs, bins, tmp_path):
    p, _ = procs.start([bins / "sleeper", "1.0"])
    wait_syscall(p.pid)
    out = tmp_path / "f"
    with Tracee.seize(p.pid) as t:
        single = []
        t.syscall = lambda nr, *a: single.append(nr) or Tracee.syscall(t, nr, *a)
        r = Remote(t, "victim")
        pid = r.queue("getpid")
        fd = r.queue_openat(str(out), os.O_CREAT | os.O_WRONLY, 0o600)
        r.install(fd, 100)  # F_GETFD of 100 needs its answer: runs what is queued before it
        assert single == [72] and pid.value == p.pid and fd.value > 2
        r.queue("write", 100, r.queue_put(b"queued\n"), 7)
        gone = r.queue("close", 999, ok_errnos=(errno.EBADF,))
        with r.batch():
            cwd = r.queue("chdir", r.queue_path("/nonexistent"), ok_errnos=(errno.ENOENT,))
        assert single == [72]  # all the rest ran in one batch
        assert (gone.value, cwd.value) == (-errno.EBADF, -errno.ENOENT)
        assert out.read_bytes() == b"queued\n" and 100 in fds(p.pid)
        assert fd.value not in fds(p.pid)

        # the first failure is raised as call() raises it; what follows did not run
        r.queue("close", 999)
        later = r.queue("getpid")
        with pytest.raises(ForkError) as ei:
            r.flush()
        assert ei.value.errno == errno.EBADF and ei.value.step == "close"
        assert "victim: close(999,)" in str(ei.value)
        with pytest.raises(ForkError):
            later.value

        # a process that refuses executable memory gets the same, one call at a time
        r2 = Remote(t, "victim")
        r2._scratch()
        r2._batched = False
        a = r2.queue("getpid")
        b = r2.queue("fcntl", 100, 1030, 0)  # F_DUPFD_CLOEXEC
        r2.queue("close", b)
        r2.flush()
        assert a.value == p.pid and b.value not in fds(p.pid)
        r2.release()

        r.call("close", 100)
        r.release()
        assert 100 not in fds(p.pid)
    res = readline(p, 5).split()
    assert res[0] == "slept" and res[2] == "eintr=0", res
    assert p.wait(5) == 0


def test_remote_queue_refuses_data_for_a_call_run_now():
    """A queued call allowed several errnos runs at once (Remote.queue): data placed for the
    queue cannot go with it, refused before anything runs in the process."""
    r = Remote(None, "victim")  # never touched: the refusal comes first
    with pytest.raises(ForkError, match="queued data"):
        r.queue("openat", 0, r.queue_path("/x"), 0, 0, ok_errnos=(errno.ENOENT, errno.EACCES))


def test_remote_queue_longer_than_one_table(procs, bins, tmp_path):
    p, _ = procs.start([bins / "sleeper", "1.0"])
    wait_syscall(p.pid)
    with Tracee.seize(p.pid) as t:
        r = Remote(t, "victim")
        n = 3 * Remote.MAX_QUEUE // 2
        paths = [tmp_path / f"f{i:03d}-{'x' * 40}" for i in range(n)]  # > one data page too
        fds_ = [r.queue_openat(str(q), os.O_CREAT | os.O_WRONLY, 0o600) for q in paths]
        closed = [r.queue("close", fd) for fd in fds_]
        r.flush()
        assert all(q.exists() for q in paths)
        assert all(c.value == 0 for c in closed) and len({fd.value for fd in fds_}) > 1
        r.release()
    assert readline(p, 5).startswith("slept")
    assert p.wait(5) == 0


# --- the control block's own page (Tracee.calls / Tracee.page), and clones that batch in it ---


def maps(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps") as f:
        return [line.split()[0] for line in f]


def page_in(pid: int, addr: int) -> bool:
    return any(int(a, 16) <= addr < int(b, 16) for a, b in (m.split("-") for m in maps(pid)))


def test_own_page_calls_and_cure_unmaps(procs, bins):
    p, _ = procs.start([bins / "sleeper", "1000", "1"])
    wait_syscall(p.pid)
    before = maps(p.pid)
    with Tracee.seize(p.pid) as t:
        addr, size = t.page()
        assert size >= 1024 and page_in(p.pid, addr)
        t.write(addr, b"hello\n")
        # a reference, an error allowed, then one that stops the rest
        rets = t.calls([(SYS_getpid, (), 0), (SYS_close, (999,), Tracee.BATCH_OK_ERR),
                        (62, (0, 0), REF(0)), (SYS_close, (998,), 0), (SYS_getpid, (), 0)])
        assert rets == [p.pid, -errno.EBADF, 0, -errno.EBADF]  # kill(getpid(), 0) = 0
        assert t.page() == (addr, size)  # one page for the whole seize
        t.cure()
        assert maps(p.pid) == before
        assert t.syscall(SYS_getpid) == p.pid
    assert maps(p.pid) == before and tracers(p.pid) == {0}


def test_pidns_clone_batches_leave_no_trace(procs, bins, tmp_path):
    ns, line = procs.start([bins / "pidns_init"], ready="init")
    init = int(line.split()[1])
    procs.extra.append(init)
    p, _ = procs.start([bins / "sleeper", "1000", "1"])
    wait_syscall(p.pid)
    before, fds_before = maps(p.pid), fds(p.pid)
    with Tracee.seize(p.pid) as t:
        kids = []
        for i in range(3):  # several clones, one page
            c = t.clone(pidns_owner=init, set_tid=p.pid + i)
            kids.append(c)
            procs.extra.append(c.pid)
            assert status(c.pid, "NSpid").split() == [str(c.pid), str(p.pid + i)]
            assert c.syscall(SYS_getpid) == p.pid + i
        addr, _ = t.page()
        assert page_in(p.pid, addr)
        for c in kids:  # MADV_DONTFORK: the clones never got it, nor the pidfds
            assert not page_in(c.pid, addr)
            assert fds(c.pid) == fds_before
            c.detach()
        assert fds(p.pid) == fds_before
    assert maps(p.pid) == before and fds(p.pid) == fds_before
    assert os.readlink(f"/proc/{p.pid}/ns/pid_for_children") == os.readlink(f"/proc/{p.pid}/ns/pid")


def test_clone_vm_child_borrows_the_page(procs, bins):
    ns, line = procs.start([bins / "pidns_init"], ready="init")
    init = int(line.split()[1])
    procs.extra.append(init)
    p, _ = procs.start([bins / "sleeper", "1000", "1"])
    wait_syscall(p.pid)
    before = maps(p.pid)
    with Tracee.seize(p.pid) as t:
        addr, _ = t.page()
        mid = t.clone(pidns_owner=init, set_tid=4242, flags=0x100, quiet_exit=True)  # CLONE_VM
        assert mid.page()[0] == addr  # the same memory: no page of its own
        assert mid.calls([(SYS_getpid, (), 0)]) == [4242]
        real = mid.clone(set_tid=4343)
        procs.extra.append(real.pid)
        assert not page_in(real.pid, addr)
        as_seen = int(status(mid.pid, "NSpid").split()[len(status(p.pid, "NSpid").split()) - 1])
        os.kill(mid.pid, signal.SIGKILL)  # as the engine does: killed while stopped
        os.waitpid(mid.pid, 0x40000000)
        mid._ctl = None  # freed: its cure must not unmap the page it borrowed
        assert page_in(p.pid, addr)
        assert t.calls([(SYS_getpid, (), 0)]) == [p.pid]
        assert t.syscall(61, as_seen, 0, 0x40000000, 0) == as_seen  # wait4: the parent reaps it
        real.detach()
    assert maps(p.pid) == before and tracers(p.pid) == {0}


MDWE_VICTIM = """
import ctypes, sys, time
if ctypes.CDLL(None, use_errno=True).prctl(65, 1, 0, 0, 0):  # PR_SET_MDWE: no W+X memory
    print("nomdwe", flush=True)
else:
    print("ready", flush=True)
time.sleep(1000)
"""


def test_no_wx_memory_calls_run_one_by_one(procs, bins):
    ns, line = procs.start([bins / "pidns_init"], ready="init")
    init = int(line.split()[1])
    procs.extra.append(init)
    p, line = procs.start([sys.executable, "-c", MDWE_VICTIM], ready=None)
    if readline(p, 20).startswith("nomdwe"):
        pytest.skip("this kernel has no PR_SET_MDWE")
    wait_syscall(p.pid)
    before, fds_before = maps(p.pid), fds(p.pid)
    with Tracee.seize(p.pid) as t:
        assert t.page() is None
        rets = t.calls([(SYS_getpid, (), 0), (62, (0, 0), REF(0)), (SYS_close, (998,), 0),
                        (SYS_getpid, (), 0)])
        assert rets == [p.pid, 0, -errno.EBADF]
        with t.clone(pidns_owner=init, set_tid=4545) as c:
            procs.extra.append(c.pid)
            assert c.syscall(SYS_getpid) == 4545
            assert fds(c.pid) == fds_before
    assert maps(p.pid) == before and fds(p.pid) == fds_before
