"""RUN: system calls made by a stopped tracee itself, in the kernel, checked from /proc (its
descriptors, namespaces and maps), from its registers, and from what it does once let go."""
import ctypes
import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import errno_as_nobody
from test_fork_verb import (PTRACE_CONT, PTRACE_DETACH, PTRACE_INTERRUPT, READER, WALL, _ptrace,
                            errno_of, event_stop, libc, seize)
from uapi import ABI

NR = {"close": 3, "ioctl": 16, "fcntl": 72, "getpid": 39, "openat": 257, "ftruncate": 77,
      "dup3": 292, "pidfd_open": 434, "setns": 308, "execve": 59, "chdir": 80, "write": 1}
AT_FDCWD = -100
CLONE_NEWNET = 0x40000000
PTRACE_GETREGS = 12
RAX, ORIG_RAX, RIP = 10, 15, 16  # struct user_regs_struct
ERESTARTSYS = 512  # the kernel's, never seen by user space
RESULT = [ABI.macro("BUNSHIN_RUN_ARG_RESULT", i) for i in range(6)]
DATA = [ABI.macro("BUNSHIN_RUN_ARG_DATA", i) for i in range(6)]
OK_ANY = ABI.BUNSHIN_RUN_OK_ANY


@pytest.fixture
def reader(tmp_path):
    """A seized Python process blocked in read(0): its call must survive RUN unharmed."""
    p = subprocess.Popen([sys.executable, "-c", READER, str(tmp_path)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    p.pid_ = int(p.stdout.readline())
    time.sleep(0.2)  # into its read()
    seize(p.pid_)
    p.out = tmp_path
    yield p
    p.kill()
    p.wait()


def regs(pid):
    buf = (ctypes.c_uint64 * 27)()
    if libc.ptrace(PTRACE_GETREGS, pid, None, ctypes.byref(buf)) < 0:
        raise OSError(ctypes.get_errno(), "PTRACE_GETREGS")
    return list(buf)


def run(dev, pid, calls, data=b""):
    """RUN, then the stop it ends in, as a tracer must."""
    req, rets = dev.run(pid, calls, data)
    assert req.resumed == 1
    event_stop(pid)
    return req, rets


def take_signal(pid, sig):
    """Let a stopped tracee with ``sig`` pending stop for it, drop it, and stop again."""
    _ptrace(PTRACE_CONT, pid)
    _, st = os.waitpid(pid, WALL)
    assert os.WIFSTOPPED(st) and os.WSTOPSIG(st) == sig, hex(st)
    _ptrace(PTRACE_INTERRUPT, pid)
    _ptrace(PTRACE_CONT, pid)  # 0: the signal is not delivered
    event_stop(pid)


def test_run_makes_the_calls_in_the_tracee(dev, reader, tmp_path):
    pid = reader.pid_
    maps, before = Path(f"/proc/{pid}/maps").read_text(), regs(pid)
    target = tmp_path / "made-by-it"
    calls = [(NR["getpid"], (), 0, 0),
             (NR["openat"], (AT_FDCWD, 0, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o640), DATA[1], 0),
             (NR["ftruncate"], (1, 12345), RESULT[0], 0),
             (NR["dup3"], (1, 100, 0), RESULT[0], 0),
             (NR["close"], (1,), RESULT[0], 0)]
    req, rets = run(dev, pid, calls, os.fsencode(target) + b"\0")
    assert req.done == 5 and rets[0] == pid and rets[1] >= 3 and rets[2:] == [0, 100, 0]
    assert target.stat().st_size == 12345 and target.stat().st_mode & 0o777 == 0o640
    assert os.readlink(f"/proc/{pid}/fd/100") == str(target)
    assert not os.path.exists(f"/proc/{pid}/fd/{rets[1]}")  # closed by it
    flags = dict(line.split(":\t") for line in Path(f"/proc/{pid}/fdinfo/100").read_text().splitlines())
    assert not int(flags["flags"], 8) & os.O_CLOEXEC  # dup3 without O_CLOEXEC, as asked
    # nothing of the call is left in it: its data is unmapped, its registers as they were,
    # or with its interrupted read() set up to restart, as any resume from a stop may leave
    # them (rax = orig_rax, rip back over the syscall instruction)
    assert Path(f"/proc/{pid}/maps").read_text() == maps
    after = regs(pid)
    if after != before:
        assert before[RAX] == -ERESTARTSYS & (1 << 64) - 1, before
        restarted = before[:RAX] + [before[ORIG_RAX]] + before[RAX + 1:RIP] + [before[RIP] - 2] + before[RIP + 1:]
        assert after == restarted
    _ptrace(PTRACE_DETACH, pid)
    reader.stdin.write("x")
    reader.stdin.flush()
    assert reader.wait(timeout=30) == 0  # its read() went on and got the byte
    assert (tmp_path / str(pid)).read_text() == "x"


def test_run_stops_at_the_first_failure_unless_told(dev, reader):
    pid = reader.pid_
    bad, next_ = (NR["close"], (9999,), 0, 0), (NR["getpid"], (), 0, 0)
    req, rets = run(dev, pid, [bad, next_])
    assert req.done == 1 and rets == [-errno.EBADF]
    req, rets = run(dev, pid, [(NR["close"], (9999,), 0, errno.EBADF), next_])
    assert req.done == 2 and rets == [-errno.EBADF, pid]
    req, rets = run(dev, pid, [(NR["close"], (9999,), 0, errno.ENOENT), next_])
    assert req.done == 1  # another errno than the one allowed
    req, rets = run(dev, pid, [(NR["close"], (9999,), OK_ANY, 0), next_])
    assert req.done == 2 and rets == [-errno.EBADF, pid]


def test_run_joins_another_namespace(dev, reader):
    """setns through a pidfd it opens itself: what the fork engine does in every clone."""
    holder = subprocess.Popen(["unshare", "-n", "sleep", "1000"])
    try:
        mine = os.readlink("/proc/self/ns/net")
        for _ in range(200):
            theirs = os.readlink(f"/proc/{holder.pid}/ns/net")
            if theirs != mine:
                break
            time.sleep(0.01)
        pid = reader.pid_
        req, rets = run(dev, pid, [(NR["pidfd_open"], (holder.pid, 0), 0, 0),
                                   (NR["setns"], (0, CLONE_NEWNET), RESULT[0], 0),
                                   (NR["close"], (0,), RESULT[0], 0)])
        assert req.done == 3 and rets[1:] == [0, 0], rets
        assert os.readlink(f"/proc/{pid}/ns/net") == theirs != mine
    finally:
        holder.kill()
        holder.wait()


def test_run_bad_input(dev, reader):
    pid = reader.pid_
    ok = (NR["getpid"], (), 0, 0)
    refused = {
        "a call not in the list": [(NR["execve"], (0, 0, 0), 0, 0)],
        "write is not in it either": [(NR["write"], (1, 0, 0), 0, 0)],
        "a result of a later call": [(NR["close"], (0,), RESULT[0], 0)],
        "a result and data in one argument": [ok, (NR["close"], (0,), RESULT[0] | DATA[0], 0)],
        "data past its end": [(NR["chdir"], (4,), DATA[0], 0)],
        "an unknown flag": [(NR["getpid"], (), 1 << 20, 0)],
        "an errno out of range": [(NR["getpid"], (), 0, 5000)],
    }
    for what, calls in refused.items():
        assert errno_of(dev.run, pid, calls, b"/\0\0\0") == errno.EINVAL, what
    assert errno_of(dev.run, pid, [ok], call_size=8) == errno.EINVAL
    assert errno_of(dev.run, pid, [ok], flags=1) == errno.EINVAL
    assert errno_of(dev.run, pid, [ok], reserved=1) == errno.EINVAL
    assert errno_of(dev.run, pid, [ok], done=1) == errno.EINVAL
    assert errno_of(dev.run, pid, []) == errno.EINVAL
    assert errno_of(dev.run, pid, [ok] * (ABI.BUNSHIN_RUN_MAX_CALLS + 1)) == errno.E2BIG
    assert errno_of(dev.run, pid, [ok], bytes(ABI.BUNSHIN_RUN_MAX_DATA + 1)) == errno.E2BIG
    assert errno_of(dev.run, os.getpid(), [ok]) == errno.EBUSY  # not our tracee
    assert errno_of(dev.run, 1 << 22, [ok]) == errno.ESRCH
    # none of it touched the tracee: it still runs a good list
    assert run(dev, pid, [ok])[1] == [pid]


def test_run_with_a_signal_pending_is_refused(dev, reader):
    """It would stop for the signal before the work: EAGAIN, not resumed; once it has taken
    the signal the same call runs."""
    pid = reader.pid_
    os.kill(pid, signal.SIGWINCH)  # ignored by it, but queued while it is traced
    for _ in range(100):
        if int(dict(l.split(":\t") for l in Path(f"/proc/{pid}/status").read_text().splitlines())
               ["SigPnd"], 16):
            break
        time.sleep(0.01)
    assert errno_of(dev.run, pid, [(NR["getpid"], (), 0, 0)]) == errno.EAGAIN
    take_signal(pid, signal.SIGWINCH)
    assert run(dev, pid, [(NR["getpid"], (), 0, 0)])[1] == [pid]


def test_run_stops_at_a_call_a_signal_interrupts(dev, reader, tmp_path):
    """A call sleeping when a signal comes would be made again by the kernel once the signal
    is delivered; RUN has no return to user mode to do that on: the list stops there, with the
    restart code, for the caller to make the call again (the library injects the rest)."""
    pid = reader.pid_
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    threading.Timer(0.5, os.kill, (pid, signal.SIGWINCH)).start()
    req, rets = dev.run(pid, [(NR["openat"], (AT_FDCWD, 0, os.O_RDONLY, 0), DATA[1], 0),
                              (NR["getpid"], (), 0, 0)], os.fsencode(fifo) + b"\0")
    assert req.resumed == 1 and req.done == 1 and rets == [-ERESTARTSYS]
    event_stop(pid)
    take_signal(pid, signal.SIGWINCH)  # still pending: it trapped for us first
    assert not [fd for fd in os.listdir(f"/proc/{pid}/fd") if os.readlink(f"/proc/{pid}/fd/{fd}") == str(fifo)]
    assert run(dev, pid, [(NR["getpid"], (), 0, 0)])[1] == [pid]


def test_run_needs_privilege(dev, reader):
    assert errno_as_nobody(f"run({reader.pid_}, [(39, (), 0, 0)])") == errno.EPERM


def test_run_syscalls_are_those_the_library_may_queue():
    """The library sends RUN only what the header allows (bunshin/fork/remote.py, the list
    compiled into bunshin._core._kmod from the same header)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bunshin._core import _kmod
    from bunshin.fork import remote

    assert _kmod.RUN_SYSCALLS == ABI.run_syscalls()
    assert _kmod.RUN_ARG_RESULT == tuple(RESULT) and _kmod.RUN_ARG_DATA == tuple(DATA)
    queued = {"close", "dup3", "fcntl", "openat", "pidfd_open", "setns", "chdir", "setsid",
              "setpgid", "ioctl", "set_robust_list", "sched_setaffinity"}  # a shell's fixups (enter_namespaces, ptys)
    assert {remote.SYS[n] for n in queued} <= _kmod.RUN_SYSCALLS
