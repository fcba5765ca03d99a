"""The backend choice (kernel module or user space) and that both backends give one answer.

On a host without /dev/bunshin these check the fallback and the BUNSHIN_KMOD override's
errors; kmod/tests/run.sh runs this file again inside a guest with bunshin.ko loaded, where
the module's answers are compared with the user-space ones.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest

import bunshin
from bunshin import doctor
from bunshin._core import kmod
from bunshin.memory import pids_usage
from conftest import wait_file, ws_status

HAVE_DEVICE = os.path.exists(kmod.DEVICE)
needs_module = pytest.mark.skipif(not HAVE_DEVICE, reason="bunshin.ko not loaded (run kmod/tests/run.sh)")
no_module = pytest.mark.skipif(HAVE_DEVICE, reason="checks the fallback; /dev/bunshin is here")


@pytest.fixture
def mode(monkeypatch):
    """Choose the backend for the duration of a test: mode("0"), mode("1"), mode("auto")."""

    def choose(value: str | None):
        if value is None:
            monkeypatch.delenv(kmod.ENV, raising=False)
        else:
            monkeypatch.setenv(kmod.ENV, value)
        kmod.reset()

    yield choose
    monkeypatch.delenv(kmod.ENV, raising=False)
    kmod.reset()


def test_public_names():
    assert set(kmod.__all__) == {"DEVICE", "ENV", "FORK_ENV", "RUN_ENV", "Backend", "Kmod", "KmodUnavailable", "backend",
                                 "reset"}
    assert bunshin._core.backend is kmod.backend


@no_module
def test_falls_back_to_user_space_without_the_device(mode):
    mode(None)
    b = kmod.backend()
    assert b.name == "user" and b.kmod is None and b.reparent is None and b.group_stats is None
    assert "/dev/bunshin is absent" in b.reason
    assert all(how.startswith("user space") for how in b.uses.values())
    rows = {c.name: c for c in doctor.backend_checks()}
    assert rows["backend"].ok and rows["backend"].detail.startswith("user (BUNSHIN_KMOD=auto)")
    assert not rows["fork parents"].ok and "copied into the parent" in rows["fork parents"].cost


def test_zero_turns_the_module_off(mode):
    mode("0")
    b = kmod.backend()
    assert b.name == "user" and b.reason == "BUNSHIN_KMOD=0"
    mode("auto")
    assert kmod.backend().mode == "auto"


@no_module
def test_one_requires_the_module(mode):
    mode("1")
    with pytest.raises(kmod.KmodUnavailable, match=r"BUNSHIN_KMOD=1 requires the kernel module, "
                                                   r"but /dev/bunshin is absent"):
        kmod.backend()
    with pytest.raises(bunshin.BunshinError, match="BUNSHIN_KMOD=1"):
        pids_usage({"me": [os.getpid()]}, pss=False)
    (row,) = doctor.backend_checks()
    assert not row.ok and "BUNSHIN_KMOD=1 requires" in row.detail


def test_a_bad_value_names_the_good_ones(mode):
    mode("yes")
    with pytest.raises(kmod.KmodUnavailable, match=r"BUNSHIN_KMOD='yes': use auto, 0 .* or 1"):
        kmod.backend()


# -- with the module loaded (inside the guest) ---------------------------------------------

@needs_module
def test_module_is_chosen_and_serves_every_job(mode):
    mode(None)
    b = kmod.backend()
    assert b.name == "kmod" and b.reparent is not None and b.group_stats is not None
    assert b.reason.startswith("/dev/bunshin: ABI v1, module ")
    assert all(how.startswith("kmod") for how in b.uses.values())
    assert all(c.ok for c in doctor.backend_checks())
    mode("1")
    assert kmod.backend().name == "kmod"


@needs_module
def test_fork_verb_can_be_left_out(mode, monkeypatch):
    monkeypatch.delenv(kmod.FORK_ENV, raising=False)
    mode(None)
    assert kmod.backend().fork is not None
    monkeypatch.setenv(kmod.FORK_ENV, "0")
    mode(None)
    b = kmod.backend()
    assert b.fork is None and b.reparent is not None
    assert b.uses["fork clones"] == f"user space: injected clone3 ({kmod.FORK_ENV}=0)"
    assert b.run is None  # RUN fixes up FORK's clones: off with it
    assert b.uses["fork fixups"] == f"user space: injected system calls ({kmod.FORK_ENV}=0)"
    rows = {c.name: c for c in doctor.backend_checks()}
    assert not rows["fork clones"].ok and rows["fork parents"].ok


FAMILY = r"""
import mmap, os, sys, time
size = int(sys.argv[1])
buf = mmap.mmap(-1, size)
for off in range(0, size, 4096):
    buf[off] = 1
kids = []
for i in range(3):
    pid = os.fork()
    if pid == 0:
        if i == 0:                      # one child rewrites half: its own copy
            for off in range(0, size // 2, 4096):
                buf[off] = 2
        print(os.getpid(), flush=True)
        time.sleep(1000)
        os._exit(0)
    kids.append(pid)
print(os.getpid(), flush=True)
time.sleep(1000)
"""


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0] == b"T"


def _usage(mode_value: str, mode, groups):
    mode(mode_value)
    return pids_usage(groups, pss=False)


@needs_module
def test_both_backends_agree_on_a_fork_family(mode):
    p = subprocess.Popen([sys.executable, "-c", FAMILY, str(16 << 20)], stdout=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        pids = sorted(int(p.stdout.readline()) for _ in range(4))
        parent = p.pid
        kids = [x for x in pids if x != parent]
        for x in pids:
            os.kill(x, signal.SIGSTOP)
        while not all(_stopped(x) for x in pids):
            time.sleep(0.01)
        gone = subprocess.Popen(["true"])
        gone.wait()  # a pid that has exited is skipped by both backends
        groups = {"a": [parent, kids[0]], "b": [kids[1], gone.pid], "c": [kids[2]],
                  "d": []}  # "d": a workspace whose processes all exited
        for _ in range(3):  # the kernel may move pages of stopped processes (compaction)
            k1 = _usage("1", mode, groups)
            u = _usage("0", mode, groups)
            k2 = _usage("1", mode, groups)
            if k1 == k2:
                break
        assert k1 == k2 == u
        assert u.shared_bytes > 8 << 20 and u.per_workspace["d"].rss_bytes == 0
        # a page the parent shares only with kids[0] is private to workspace "a"
        assert u.per_workspace["a"].private_bytes > 0
        mode("1")
        with_pss = pids_usage(groups)
        mode("0")
        assert with_pss.pss_bytes == pids_usage(groups).pss_bytes > 0
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@needs_module
def test_both_backends_agree_on_forked_workspaces(family, mode):
    ws = bunshin.Workspace.create()
    family.append(ws)
    # forked once it holds its 8 MiB (python may take over a second to start in the guest)
    ws.spawn(["python3", "-c", "b = bytearray(8 << 20); open('/tmp/ready', 'w').close(); "
              "import time; time.sleep(1000)"])
    wait_file(ws, "/tmp/ready", 60)
    family.extend(ws.fork(2))
    for _ in range(3):
        mode("1")
        k = bunshin.memory.family_usage(family, pss=False)
        mode("0")
        u = bunshin.memory.family_usage(family, pss=False)
        if k == u:
            break
    assert k == u and k.shared_bytes > 8 << 20


@needs_module
def test_fixups_run_in_the_kernel(mode, monkeypatch):
    """With RUN, a clone's queued fixups (namespaces, cwd, session, terminal) are made by the
    clone itself in the kernel: no batch is injected into it and no scratch memory mapped;
    the child's shell has its namespaces, directory, session and terminal all the same."""
    from bunshin.compel import Tracee
    from bunshin.fork import remote

    mode("1")
    assert kmod.backend().run is not None
    runs, injected = [], []
    real_run, real_mmap = kmod.Kmod.run, Tracee.mmap
    monkeypatch.setattr(kmod.Kmod, "run", lambda self, pid, calls, data=b"":
                        runs.append((pid, [c[0] for c in calls])) or real_run(self, pid, calls, data))
    monkeypatch.setattr(Tracee, "mmap", lambda self, *a: injected.append(self.pid) or real_mmap(self, *a))
    ws = bunshin.Workspace.create()
    try:
        sh = ws.shell()
        sh.run("mkdir -p /tmp/here && cd /tmp/here")
        (kid,) = ws.fork(1)
        try:
            bash = kid.shells[0]
            r = bash.run("echo $$ $(pwd) $(ps -o sid= -p $$) $(tty); readlink /proc/$$/ns/net")
            pid, cwd, sid, tty, net = r.stdout.decode().split()
            assert (pid, cwd, sid) == (str(sh.pid), "/tmp/here", str(sh.pid)) and tty.startswith("/dev/pts/")
            assert net == os.readlink(f"/proc/{kid.init_pid}/ns/net")
            # its CPUs given back with the fixups, not pinned to the engine's as during the fork
            mine = [l for l in open("/proc/self/status") if l.startswith("Cpus_allowed_list:")]
            assert ws_status(kid, sh.pid, "Cpus_allowed_list") == mine[0].split(":")[1].strip()
            clones = {p for p, _ in runs}
            assert clones and not clones & set(injected), (runs, injected)
            # FORK made them in the child's namespaces: nothing left to join (module 0.5.0)
            assert kmod.backend().fork_in_parent is not None
            assert not any(remote.SYS["setns"] in nrs for _, nrs in runs), runs
        finally:
            kid.close()
    finally:
        ws.close()


def _wait_slot_with_mids(core) -> None:
    deadline = time.monotonic() + 10
    while not any(s.early is not None and s.early.mids for s in core.slots):
        assert time.monotonic() < deadline, "no slot with intermediates was made ahead"
        time.sleep(0.02)


@needs_module
@pytest.mark.parametrize("fork_verb", ["1", "0"])
def test_clones_are_born_in_the_child(mode, monkeypatch, fork_verb):
    """FORK IN_PARENT makes each clone in the child's namespaces, root, cgroups, at its
    init's directory but with its own umask: no setns in its fixups, no cgroup.procs write for
    it, and yet every process of the child is in the child's cgroup and namespaces, in its
    directory, with its umask. A slot made ahead for the user-space engine (its
    intermediates in the child's cgroup) used by a fork with the module does not pass for
    one: its intermediates go unused and the clones are in the child's cgroup all the same,
    also when cloned by injection (BUNSHIN_KMOD_FORK=0; they were left in the template's)."""
    from bunshin.fork import remote
    from bunshin.runtime.cgroup import base

    mode("0")
    ws = bunshin.Workspace.create()
    try:
        sh = ws.shell()
        sh.run("umask 027; mkdir -p /tmp/here && cd /tmp/here; sleep 1000 &")
        tpl = ws.snapshot()
        try:
            tpl.fork(1)[0].close()  # held now: the next slot is made ahead, with intermediates
            _wait_slot_with_mids(tpl._core)
            monkeypatch.setenv(kmod.FORK_ENV, fork_verb)
            mode("1")
            assert (kmod.backend().fork_in_parent is not None) == (fork_verb == "1")
            added, real_add = [], base.Cgroup.add
            monkeypatch.setattr(base.Cgroup, "add", lambda self, pid: added.append(pid) or real_add(self, pid))
            queued, real_first = [], remote.RunRemote._ran_first  # every queue, in the kernel or injected

            def first(self, q, data):
                queued.append([e[0] for e in q])
                return real_first(self, q, data)

            monkeypatch.setattr(remote.RunRemote, "_ran_first", first)
            (kid,) = tpl.fork(1)
            try:
                procs = kid.processes()
                inner = {}
                for h in kid.host_pids():
                    with open(f"/proc/{h}/status") as f:
                        inner[int(next(l for l in f if l.startswith("NSpid:")).split()[-1])] = h
                assert len(procs) == 3 and sorted(inner) == sorted(p.pid for p in procs)
                init = f"/proc/{kid.init_pid}"
                for p in procs:
                    assert kid.read_file(f"/proc/{p.pid}/cgroup") == kid.read_file("/proc/1/cgroup")
                    for ns in ("mnt", "net", "ipc", "uts", "pid"):
                        assert (os.readlink(f"{init}/root/proc/{p.pid}/ns/{ns}")
                                == os.readlink(f"{init}/ns/{ns}")), (p, ns)
                bash = kid.shells[0]
                r = bash.run("echo $(pwd) $(umask) $(readlink /proc/$$/root)")
                assert r.stdout.decode().split() == ["/tmp/here", "0027", "/"]
                if fork_verb == "1":
                    # whether a queue runs in the kernel or is injected depends on what else it
                    # holds: none may enter the child's namespaces
                    assert queued and not any("setns" in names for names in queued), queued
                    clones = set(kid.host_pids()) - {kid.init_pid}
                    assert not clones & set(added), (clones, added)
            finally:
                kid.close()
        finally:
            tpl.close()
    finally:
        ws.close()


@needs_module
def test_a_queue_a_signal_interrupts_goes_on_by_injection(mode, tmp_path, monkeypatch):
    """RUN stops at a call a signal interrupts (a FIFO's open, here); the Remote makes that
    call and the rest by injection, which takes the signal and restarts the call as a system
    call would: every result arrives, in order."""
    import threading

    from bunshin.compel import Tracee
    from bunshin.fork import remote

    mode("1")
    k = kmod.backend().run
    assert k is not None
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    p = subprocess.Popen(["sleep", "1000"])
    try:
        t = Tracee.seize(p.pid)
        runs = []
        real = kmod.Kmod.run

        def counted(self, pid, calls, data=b""):
            out = real(self, pid, calls, data)
            runs.append(out)
            return out

        monkeypatch.setattr(kmod.Kmod, "run", counted)
        r = remote.RunRemote(t, "sleep", k)
        fd = r.queue_openat(str(fifo), os.O_RDONLY)
        me = r.queue("getpid")
        threading.Timer(0.5, os.kill, (p.pid, signal.SIGWINCH)).start()
        writer = threading.Timer(1.5, lambda: os.close(os.open(fifo, os.O_WRONLY)))
        writer.start()
        r.flush()
        writer.join()
        assert runs == [[-512]]  # RUN stopped at the open with ERESTARTSYS
        assert fd.value >= 0 and me.value == p.pid
        assert os.readlink(f"/proc/{p.pid}/fd/{fd.value}") == str(fifo)
        r.release()
        t.detach()
    finally:
        p.kill()
        p.wait()


@needs_module
def test_forks_the_module_gives_up_on_fail_cleanly(mode, no_leaks):
    """With fork_timeout_ms=0 FORK (and RUN) give up at once unless the work already ran, so
    most forks fail half-way, in the kernel: each one either makes a whole child or raises a
    ForkError, the source runs on intact, and nothing of the failed ones is left."""
    import collections
    from pathlib import Path

    from bunshin.errors import ForkError

    knob = Path("/sys/module/bunshin/parameters/fork_timeout_ms")
    mode("1")
    ws = bunshin.Workspace.create()
    outcomes: collections.Counter = collections.Counter()
    old = knob.read_text().strip()
    try:
        sh = ws.shell()
        sh.run("V=intact")
        procs = [p.pid for p in ws.processes()]
        knob.write_text("0")
        for _ in range(8):
            try:
                (kid,) = ws.fork(1)
            except ForkError as e:
                assert e.errno == errno.ETIMEDOUT and e.step in ("fork", "run"), e
                assert "did not get to the work within the module's fork_timeout_ms" in str(e)
                outcomes[e.step] += 1
            else:
                outcomes["made"] += 1
                assert kid.shells[0].run("echo $V").stdout == b"intact\n"
                kid.close()
            assert [p.pid for p in ws.processes()] == procs
            assert sh.run("echo $V").stdout == b"intact\n"
        assert outcomes["fork"] + outcomes["run"] > 0, outcomes  # the failure path was taken
    finally:
        knob.write_text(old)
        ws.close()
    print(f"no patience: {dict(outcomes)}")
