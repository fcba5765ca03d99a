"""bunshin.compel against real victims: bash, python3, C programs (single and multi-threaded).

Every test checks the victim's own observable behaviour afterwards (its output, its memory,
/proc), and kills every process it started.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bunshin.compel import SYS_exit_group, SYS_getpid, Tracee
from bunshin.errors import ForkError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ptrace of other processes needs root")

VICTIMS = Path(__file__).parent / "victims"
SYS_ppoll = 271
SYS_getcwd = 79
SIGUSR1 = int(signal.SIGUSR1)


@pytest.fixture(scope="session")
def bins(tmp_path_factory):
    out = tmp_path_factory.mktemp("victims")
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is needed to build the C victims")
    for name in ("sleeper", "threads", "pidns_init"):
        subprocess.run([gcc, "-O2", "-pthread", "-o", out / name, VICTIMS / f"{name}.c"],
                       check=True)
    return out


class Procs:
    """Starts victims; kills them (and any extra pid registered) at teardown."""

    def __init__(self):
        self.popens: list[subprocess.Popen] = []
        self.extra: list[int] = []

    def start(self, argv, ready: str | None = "ready", **kw) -> tuple[subprocess.Popen, str]:
        p = subprocess.Popen(argv, stdin=kw.pop("stdin", subprocess.DEVNULL),
                             stdout=subprocess.PIPE, text=True, **kw)
        self.popens.append(p)
        line = ""
        if ready:
            line = readline(p, 20)
            assert line.startswith(ready), line
        return p, line

    def cleanup(self):
        for pid in self.extra:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.popens:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                # a failed test left threads traced by us: as zombies they wait for their
                # tracer, and the process for them
                for tid in os.listdir(f"/proc/{p.pid}/task"):
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(int(tid), os.WNOHANG | 0x40000000)  # __WALL
                p.wait(10)
            if p.stdout:
                p.stdout.close()
            if p.stdin:
                p.stdin.close()


@pytest.fixture
def procs():
    ps = Procs()
    yield ps
    ps.cleanup()


def readline(p: subprocess.Popen, timeout: float) -> str:
    r, _, _ = select.select([p.stdout], [], [], timeout)
    assert r, f"victim {p.pid} printed nothing within {timeout}s"
    return p.stdout.readline().strip()


def status(pid: int, key: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
    raise KeyError(key)


def tracers(pid: int) -> set[int]:
    """TracerPid of every thread; threads that exit while we look are skipped."""
    out = set()
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            out.add(int(status(int(t), "TracerPid")))
        except FileNotFoundError:
            pass
    return out


def pss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    raise KeyError("Pss")


def wait_for(pred, timeout=10.0, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def wait_syscall(pid: int, timeout=5.0):
    """Until the victim sleeps inside a system call (not merely started)."""
    wait_for(lambda: Path(f"/proc/{pid}/syscall").read_text().split()[0] not in ("running", "-1")
             and status(pid, "State").startswith("S"), timeout, f"{pid} to block")


# --- single-threaded victims: inject, then the victim carries on unharmed ---------------------


def test_bash_blocked_in_read(procs):
    p, _ = procs.start(["bash", "-c", "echo ready; read x; echo got:$x"], stdin=subprocess.PIPE)
    wait_syscall(p.pid)
    with Tracee.seize(p.pid) as t:
        assert t.thread_state().in_syscall
        assert t.syscall(SYS_getpid) == p.pid
    assert tracers(p.pid) == {0}
    p.stdin.write("hello\n")
    p.stdin.flush()
    assert readline(p, 5) == "got:hello"  # read() restarted and got the line
    assert p.wait(5) == 0


def test_bash_waiting_for_child(procs):
    p, _ = procs.start(["bash", "-c", "echo ready; sleep 0.5; echo rc=$?"])
    wait_syscall(p.pid)
    with Tracee.seize(p.pid) as t:
        for _ in range(10):
            assert t.syscall(SYS_getpid) == p.pid
    assert readline(p, 5) == "rc=0"  # wait4 restarted, saw the child exit normally
    assert p.wait(5) == 0


def test_python_busy_loop(procs):
    n = 20_000_000
    code = f"print('ready', flush=True)\ns = 0\nfor i in range({n}): s += i\nprint(s)"
    p, _ = procs.start([sys.executable, "-c", code])
    time.sleep(0.3)
    with Tracee.seize(p.pid) as t:
        st = t.thread_state()
        assert not st.in_syscall  # stopped in user code: the syscall comes from elsewhere
        assert t.syscall(SYS_getpid) == p.pid
    assert int(readline(p, 30)) == n * (n - 1) // 2
    assert p.wait(5) == 0


def test_nanosleep_restarts_with_full_duration(procs, bins):
    p, _ = procs.start([bins / "sleeper", "1.0"])
    wait_syscall(p.pid)
    with Tracee.seize(p.pid) as t:
        st = t.thread_state()
        assert st.in_syscall and st.regs["orig_rax"] == 230  # clock_nanosleep
        assert t.syscall(SYS_getpid) == p.pid
        time.sleep(0.2)  # time passes while it is stopped: the restart must account for it
    out = readline(p, 5).split()
    assert out[0] == "slept" and out[2] == "eintr=0", out  # no EINTR leaked into the victim
    assert 1000 <= int(out[1]) < 1500
    assert p.wait(5) == 0


def test_remote_mmap_write_read(procs, bins):
    p, _ = procs.start([bins / "sleeper", "1.0"], cwd="/usr/share")
    wait_syscall(p.pid)
    with Tracee.seize(p.pid) as t:
        addr = t.mmap(8192)
        maps = Path(f"/proc/{p.pid}/maps").read_text()
        assert f"{addr:x}-" in maps
        data = os.urandom(8192)
        t.write(addr, data)
        assert t.read(addr, 8192) == data
        # a syscall run in the victim fills the victim's memory: its cwd, as /proc sees it
        n = t.syscall(SYS_getcwd, addr, 4096)
        assert t.read(addr, n - 1).decode() == os.readlink(f"/proc/{p.pid}/cwd")
        t.munmap(addr, 8192)
        assert f"{addr:x}-" not in Path(f"/proc/{p.pid}/maps").read_text()
    assert readline(p, 5).startswith("slept")
    assert p.wait(5) == 0


def test_signal_during_injection_is_delivered_after(procs, bins):
    p, _ = procs.start([bins / "sleeper", "1.5"])
    wait_syscall(p.pid)
    with Tracee.seize(p.pid) as t:
        ts = t.mmap(4096)
        t.write(ts, (0).to_bytes(8, "little") + (400_000_000).to_bytes(8, "little"))
        threading.Timer(0.1, os.kill, (p.pid, signal.SIGUSR1)).start()
        t0 = time.monotonic()
        assert t.syscall(SYS_ppoll, 0, 0, ts, 0, 8) == 0  # restarted after the held signal
        assert time.monotonic() - t0 >= 0.35
        assert t.held_signals() == [SIGUSR1]
        t.munmap(ts, 4096)
    # the kernel delivers it with the sender's siginfo; the handler interrupts nanosleep (EINTR)
    assert readline(p, 5) == f"usr1 from {os.getpid()}"
    out = readline(p, 5).split()
    assert out[0] == "slept" and out[2] == "eintr=1", out
    assert p.wait(5) == 0


# --- threads -------------------------------------------------------------------------------


def thread_counts(t, counters: int, n: int) -> list[int]:
    """The n 64-bit loop counters of the threads program, read from the stopped process."""
    raw = t.read(counters, 8 * n)
    return [int.from_bytes(raw[i:i + 8], "little") for i in range(0, 8 * n, 8)]


def test_all_threads_stop_and_resume(procs, bins):
    n = 16
    p, line = procs.start([bins / "threads", str(n)])
    counters = int(line.split()[2], 16)
    time.sleep(0.2)

    def read_counts(t):
        return thread_counts(t, counters, n)

    with Tracee.seize(p.pid) as t:
        tids = t.stop_all()
        assert len(tids) >= n + 2  # main + counters + churn (+ maybe a short-lived one)
        assert set(tids) >= {int(x) for x in os.listdir(f"/proc/{p.pid}/task")}
        before = read_counts(t)
        time.sleep(0.2)
        assert read_counts(t) == before  # nobody counts while stopped
        # a churn thread caught while exiting cannot stop; it is gone once reaped
        live = [tid for tid in tids if os.path.exists(f"/proc/{p.pid}/task/{tid}")]
        assert len(live) >= n + 1
        assert all(status(tid, "State").startswith("t") for tid in live)
        assert t.syscall(SYS_getpid) == p.pid
        states = [t.thread_state(tid) for tid in live]
        assert len({s.regs["fs_base"] for s in states}) == len(live)  # one TCB each
        xs = t.xstate(live[1])
        assert len(xs) >= 576 and int.from_bytes(xs[512:520], "little") & 0x3  # XSAVE: x87+SSE
        assert all(s.tid_addr and int.from_bytes(t.read(s.tid_addr, 4), "little") == s.vtid
                   for s in states)
    assert tracers(p.pid) == {0}
    with Tracee.seize(p.pid) as t:  # let them run 0.3 s untraced, then look again
        pass
    time.sleep(0.3)
    with Tracee.seize(p.pid) as t:
        after = read_counts(t)
    assert all(a > b for a, b in zip(after, before)), (before, after)


def test_victim_killed_mid_injection_multithreaded(procs, bins):
    p, _ = procs.start([bins / "threads", "4"])
    t = Tracee.seize(p.pid)
    try:
        t.stop_all()
        ts = t.mmap(4096)
        t.write(ts, (30).to_bytes(8, "little") + bytes(8))
        threading.Timer(0.2, os.kill, (p.pid, signal.SIGKILL)).start()
        with pytest.raises(ForkError) as ei:
            t.syscall(SYS_ppoll, 0, 0, ts, 0, 8)
        assert ei.value.pid == p.pid and ei.value.step == "syscall"
        assert str(p.pid) in str(ei.value)
        assert not t.alive
    finally:
        t.detach()
    assert p.wait(5) == -signal.SIGKILL
    assert not Path(f"/proc/{p.pid}").exists()


def test_victim_exits_mid_injection(procs, bins):
    p, _ = procs.start([bins / "sleeper", "10"])
    wait_syscall(p.pid)
    t = Tracee.seize(p.pid)
    with pytest.raises(ForkError) as ei:
        t.syscall(SYS_exit_group, 3)
    assert ei.value.pid == p.pid
    t.detach()  # nothing left to detach from: must not raise or hang
    assert p.wait(5) == 3
    with pytest.raises(ForkError) as ei:
        Tracee.seize(p.pid)
    assert ei.value.step == "seize"


# --- clone ---------------------------------------------------------------------------------


def test_a_clone_can_owe_its_robust_list_to_the_caller(procs):
    """``owe_robust``: the clone comes without the robust list fork(2) dropped; the caller
    gets it once and sets it in a batch of its own."""
    p, _ = procs.start([sys.executable, "-c", "import time\nprint('ready', flush=True)\ntime.sleep(1000)"])
    with Tracee.seize(p.pid) as t:
        want = t.thread_state().robust_list
        assert want[0]
        t.learn()  # read ahead what the clone needs: the same clone after
        with t.clone(owe_robust=True) as child:
            procs.extra.append(child.pid)
            assert child.thread_state().robust_list[0] == 0
            owed = child.take_owed_robust()
            assert owed == want and child.take_owed_robust() is None
            assert child.syscall(273, *owed) == 0  # set_robust_list
            assert child.thread_state().robust_list == want
        with t.clone() as child:  # by default compel sets it itself
            procs.extra.append(child.pid)
            assert child.take_owed_robust() is None
            assert child.thread_state().robust_list == want


def test_clone_shares_memory_copy_on_write(procs, tmp_path):
    mib = 256
    p, _ = procs.start([sys.executable, str(VICTIMS / "holder.py"), str(tmp_path), str(mib)])
    wait_syscall(p.pid)
    before = pss_kib(p.pid)
    assert before > mib * 1024
    with Tracee.seize(p.pid) as t:
        with t.clone() as child:
            procs.extra.append(child.pid)
            assert int(status(child.pid, "PPid")) == p.pid
            st = child.thread_state()
            assert int.from_bytes(child.read(st.tid_addr, 4), "little") == child.pid
            assert st.robust_list == t.thread_state().robust_list
    assert tracers(p.pid) == {0} and tracers(child.pid) == {0}
    parent_pss, child_pss = pss_kib(p.pid), pss_kib(child.pid)
    assert abs(parent_pss - before / 2) < before * 0.1, (before, parent_pss)
    assert abs(child_pss - before / 2) < before * 0.1, (before, child_pss)
    os.kill(child.pid, signal.SIGUSR1)  # the child is a working python: it answers signals
    wait_for(lambda: (tmp_path / f"pid.{child.pid}").exists(), what="child's pid file")
    assert (tmp_path / f"pid.{child.pid}").read_text().split() == [str(child.pid)] * 2
    os.kill(child.pid, signal.SIGUSR2)
    wait_for(lambda: (tmp_path / f"dirty.{child.pid}").exists(), what="child rewrite")
    assert pss_kib(child.pid) > mib * 1024 * 0.95
    assert pss_kib(p.pid) > mib * 1024 * 0.95


def test_clone_into_pid_namespace_with_same_pid(procs, bins, tmp_path):
    ns, line = procs.start([bins / "pidns_init"], ready="init")
    init = int(line.split()[1])
    procs.extra.append(init)  # killing the namespace's init ends everything inside it
    p, _ = procs.start([sys.executable, str(VICTIMS / "holder.py"), str(tmp_path), "8"])
    wait_syscall(p.pid)
    with Tracee.seize(p.pid) as t:
        with t.clone(pidns_owner=init, set_tid=p.pid) as child:
            procs.extra.append(child.pid)
            assert status(child.pid, "NSpid").split() == [str(child.pid), str(p.pid)]
            assert child.in_parent == child.pid  # as the victim, in our namespace, sees it
            st = child.thread_state()
            assert st.vtid == p.pid
            assert int.from_bytes(child.read(st.tid_addr, 4), "little") == p.pid
            assert child.syscall(SYS_getpid) == p.pid
    # the victim's own namespace for children is back, and the pidfds it used are closed
    assert os.readlink(f"/proc/{p.pid}/ns/pid_for_children") == os.readlink(f"/proc/{p.pid}/ns/pid")
    for pid in (p.pid, child.pid):
        fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        assert not any("pidfd" in f for f in fds), fds
    os.kill(child.pid, signal.SIGUSR1)
    wait_for(lambda: (tmp_path / f"pid.{child.pid}").exists(), what="child's pid file")
    assert (tmp_path / f"pid.{child.pid}").read_text().split() == [str(child.pid), str(p.pid)]


def test_costs_injection_vs_native_fork(procs, bins, capsys):
    p, _ = procs.start([bins / "sleeper", "1000", "256"])
    wait_syscall(p.pid)
    rt, cl = [], []
    with Tracee.seize(p.pid) as t:
        for _ in range(200):
            t0 = time.perf_counter()
            t.syscall(SYS_getpid)
            rt.append(time.perf_counter() - t0)
    for _ in range(20):
        with Tracee.seize(p.pid) as t:
            t0 = time.perf_counter()
            child = t.clone()
            cl.append(time.perf_counter() - t0)
            procs.extra.append(child.pid)
            child.detach()
        os.kill(child.pid, signal.SIGKILL)  # and wait until the victim reaped it, as fork() did
        wait_for(lambda: not Path(f"/proc/{child.pid}").exists(), what="child reaped")
    os.kill(p.pid, signal.SIGUSR2)
    line = readline(p, 30)
    while not line.startswith("fork_us"):
        line = readline(p, 30)
    native = float(line.split()[1])
    inj_rt, inj_clone = statistics.median(rt) * 1e6, statistics.median(cl) * 1e6
    with capsys.disabled():
        print(f"\n[compel costs, 256 MiB C victim] injected getpid round trip {inj_rt:.1f} us; "
              f"injected clone3 {inj_clone:.0f} us vs native fork() {native:.0f} us (medians)")
    assert inj_rt < inj_clone
    assert inj_clone < 3 * native  # page-table copy dominates both; injection adds little


def test_public_api():
    import bunshin.compel as compel

    assert set(compel.__all__) == {"Tracee", "ThreadState", "SYS_getpid", "SYS_exit_group"}
    assert all(hasattr(compel, name) for name in compel.__all__)
