"""FORK: real processes cloned by the module into a pid namespace of their own, checked from
/proc and from what the clones themselves write once they run."""
import ctypes
import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import errno_as_nobody, errno_without_cap
from uapi import ABI

libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
PTRACE_CONT, PTRACE_DETACH, PTRACE_SEIZE, PTRACE_INTERRUPT = 7, 17, 0x4206, 0x4207
PTRACE_EVENT_STOP = 128
WALL = 0x40000000

# Writes "pid ppid counter marker" to OUT/<its pid> every 20 ms: a clone proves it runs, in
# which pid namespace and under which parent, with the source's memory.
LOOPER = r"""
import ctypes, os, sys, time
out, marker = sys.argv[1], sys.argv[2]
slot = ctypes.c_int32(-1)
print(os.getpid(), ctypes.addressof(slot), flush=True)
n = 0
while True:
    n += 1
    me = os.getpid()
    with open(f"{out}/{me}.tmp", "w") as f:
        f.write(f"{me} {os.getppid()} {n} {marker} {slot.value}\n")
    try:
        os.rename(f"{out}/{me}.tmp", f"{out}/{me}")
    except FileNotFoundError:
        pass  # cloned between write and rename: the source and each clone race to rename it
    time.sleep(0.02)
"""

# Blocked in read(): the clone must restart the interrupted call, not return from it.
READER = r"""
import os, sys
print(os.getpid(), flush=True)
b = os.read(0, 1)
with open(f"{sys.argv[1]}/{os.getpid()}", "wb") as f:
    f.write(b)
"""

# A pid namespace whose init (pid 1) reaps what is given to it; prints the init's host pid.
NS = r"""
import ctypes, os, time
if ctypes.CDLL(None, use_errno=True).unshare(0x20000000):
    raise OSError(ctypes.get_errno(), "unshare")
pid = os.fork()
if pid == 0:
    while True:
        try:
            os.wait()
        except ChildProcessError:
            time.sleep(0.05)
print(pid, flush=True)
os.waitpid(pid, 0)
"""


def _ptrace(req, pid, data=0):
    if libc.ptrace(req, pid, None, ctypes.c_void_p(data)) < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def event_stop(pid):
    """Wait for pid's PTRACE_EVENT_STOP; a signal stop that comes first is delivered."""
    while True:
        _, st = os.waitpid(pid, WALL)
        assert os.WIFSTOPPED(st), f"{pid}: status {st:#x}"
        if st >> 16 == PTRACE_EVENT_STOP:
            return
        _ptrace(PTRACE_CONT, pid, os.WSTOPSIG(st))
        _ptrace(PTRACE_INTERRUPT, pid)


def seize(pid):
    _ptrace(PTRACE_SEIZE, pid)
    _ptrace(PTRACE_INTERRUPT, pid)
    event_stop(pid)


def status(pid):
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.split()
    return out


def kill_all(pids, traced=False):
    """SIGKILL; ``traced``: they are our tracees, so also collect them (a traced zombie keeps
    its pid namespace, and so its init, from ever finishing)."""
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            continue
        if traced:
            try:
                os.waitpid(p, WALL)
            except ChildProcessError:
                pass


def errno_of(fn, *a, **kw):
    """The errno of a call refused before the source was resumed (so it is still stopped)."""
    with pytest.raises(OSError) as e:
        fn(*a, **kw)
    assert not getattr(e.value, "resumed", False)
    return e.value.errno


def read_until(path, pred, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = path.read_text()
            if pred(text):
                return text
        except FileNotFoundError:
            pass
        time.sleep(0.02)
    raise AssertionError(f"{path}: never satisfied (last: {path.read_text() if path.exists() else 'absent'})")


def looper_count(looper):
    """How many times the looper has written its own line so far."""
    return int((looper.out / str(looper.pid)).read_text().split()[2])


def runs_on(looper, since=None):
    """The looper's own line once it has counted two past ``since`` (default: its count now):
    it runs, and runs its own code."""
    n = looper_count(looper) if since is None else since
    return read_until(looper.out / str(looper.pid),
                      lambda t: t.endswith("\n") and int(t.split()[2]) > n + 2).split()


@pytest.fixture
def ns():
    p = subprocess.Popen([sys.executable, "-c", NS], stdout=subprocess.PIPE, text=True)
    init = int(p.stdout.readline())
    yield init
    kill_all([init])
    p.wait(timeout=30)


@pytest.fixture
def looper(tmp_path):
    marker = os.urandom(6).hex()
    p = subprocess.Popen([sys.executable, "-c", LOOPER, str(tmp_path), marker],
                         stdout=subprocess.PIPE, text=True)
    pid, slot = map(int, p.stdout.readline().split())
    read_until(tmp_path / str(pid), bool)
    p.slot, p.marker, p.out = slot, marker, tmp_path
    yield p
    p.kill()
    p.wait()


def test_fork_makes_children_in_a_namespace_with_chosen_pids(dev, ns, looper):
    seize(looper.pid)
    kids = []
    try:
        req, kids = dev.fork(looper.pid, [(ns, 0, 0), (ns, 50, 0), (ns, 51, 0)],
                             child_tid=looper.slot)
        assert req.done == 3 and len(kids) == 3
        event_stop(looper.pid)  # the source stops again and waits for us
        for k in kids:
            event_stop(k)  # each child: traced by us, stopped before any user code
            st = status(k)
            assert st["PPid"] == [str(ns)]
            assert st["TracerPid"] == [str(os.getpid())]
            assert st["NSpid"][0] == str(k)
        vpids = [int(status(k)["NSpid"][-1]) for k in kids]
        assert vpids[1:] == [50, 51] and vpids[0] not in (1, 50, 51)
        for p in (looper.pid, *kids):
            _ptrace(PTRACE_DETACH, p)
        for k, v in zip(kids, vpids):
            line = read_until(looper.out / str(v), lambda t: t.endswith("\n")).split()
            # its own pid, its parent the namespace's init, the source's memory; CHILD_SETTID
            assert line[0] == str(v) and line[1] == "1" and line[3] == looper.marker
            assert line[4] == str(v)
        line = runs_on(looper)
        assert line[:2] == [str(looper.pid), str(os.getpid())] and line[4] == "-1"  # untouched
    finally:
        kill_all(kids)


# A daemon that dropped root for good: every uid and gid 1001, no capability left.
DROPPED = r"""
import os, time
os.setgroups([2001])
os.setresgid(1001, 1001, 1001)
os.setresuid(1001, 1001, 1001)
print(os.getpid(), flush=True)
while True:
    time.sleep(0.02)
"""


def test_fork_of_a_task_under_another_uid_keeps_its_credentials(dev, ns):
    """A task without CAP_CHECKPOINT_RESTORE cannot take a chosen pid itself (clone3's
    set_tid): the module lends it that for the copy alone, and the copy runs with the task's
    own credentials, not the lent ones."""
    p = subprocess.Popen([sys.executable, "-c", DROPPED], stdout=subprocess.PIPE, text=True)
    pid = int(p.stdout.readline())
    kids = []
    try:
        seize(pid)
        keys = ("Uid", "Gid", "Groups", "CapEff", "CapPrm", "CapBnd")
        before = {k: status(pid)[k] for k in keys}
        assert before["Uid"] == ["1001"] * 4 and before["CapEff"] == ["0000000000000000"]
        req, kids = dev.fork(pid, [(ns, 60, 0)])
        event_stop(pid)
        event_stop(kids[0])
        assert status(kids[0])["NSpid"][-1] == "60"
        for t in (pid, kids[0]):
            assert {k: status(t)[k] for k in keys} == before
        for t in (pid, *kids):
            _ptrace(PTRACE_DETACH, t)
        time.sleep(0.1)
        assert status(kids[0])["State"][0] in "SR"  # runs on (sleeps in its loop)
    finally:
        kill_all(kids)
        p.kill()
        p.wait()


def test_fork_restarts_the_interrupted_system_call(dev, ns, tmp_path):
    r = subprocess.Popen([sys.executable, "-c", READER, str(tmp_path)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
    pid = int(r.stdout.readline())
    time.sleep(0.2)  # into read()
    kids = []
    try:
        seize(pid)
        _, kids = dev.fork(pid, [(ns, 70, 0)])
        event_stop(pid)
        event_stop(kids[0])
        for p in (pid, *kids):
            _ptrace(PTRACE_DETACH, p)
        r.stdin.write(b"ab")
        r.stdin.flush()
        got = {read_until(tmp_path / name, bool, 20) for name in (str(pid), "70")}
        assert got == {"a", "b"}  # each read one byte: both were still in read()
        assert r.wait(timeout=20) == 0
    finally:
        kill_all([pid, *kids])
        r.wait()


def test_fork_bad_input(dev, ns, looper):
    pid = looper.pid
    assert errno_of(dev.fork, pid, [(ns, 0, 0)]) == errno.EBUSY  # not ours
    seize(pid)
    made = []
    try:
        assert errno_of(dev.fork, pid, [(ns, 0, 0)], flags=2) == errno.EINVAL  # unknown
        assert errno_of(dev.fork, pid, [(ns, 0, 0)], reserved=1) == errno.EINVAL
        assert errno_of(dev.fork, pid, [(ns, 0, 0)], child_size=8) == errno.EINVAL
        assert errno_of(dev.fork, pid, []) == errno.EINVAL
        assert errno_of(dev.fork, pid, [(ns, 0, 0)] * (ABI.BUNSHIN_FORK_MAX_CHILDREN + 1)) == errno.E2BIG
        assert errno_of(dev.fork, 0x3fffff00, [(ns, 0, 0)]) == errno.ESRCH
        assert errno_of(dev.fork, pid, [(0x3fffff00, 0, 0)]) == errno.ESRCH
        # a parent outside the child's namespace
        assert errno_of(dev.fork, pid, [(ns, 0, os.getpid())]) == errno.EXDEV
        # the source's own namespace with a parent from another one
        assert errno_of(dev.fork, pid, [(0, 0, ns)]) == errno.EXDEV
        # pid 1 is taken (the init): the first child is made, the second is not
        with pytest.raises(OSError) as e:
            dev.fork(pid, [(ns, 90, 0), (ns, 1, 0)])
        assert e.value.errno == errno.EEXIST and e.value.resumed
        made = e.value.made
        assert len(made) == 1 and status(made[0])["NSpid"][-1] == "90"
        event_stop(pid)
        event_stop(made[0])
        # a running task is refused
        _ptrace(PTRACE_CONT, pid)
        assert errno_of(dev.fork, pid, [(ns, 0, 0)]) == errno.EBUSY
        _ptrace(PTRACE_INTERRUPT, pid)
        event_stop(pid)
        _ptrace(PTRACE_DETACH, pid)
        runs_on(looper)
    finally:
        kill_all(made, traced=True)


def test_fork_of_a_task_stopped_by_a_signal(dev, ns, looper):
    """Seized in its group stop (SIGSTOP), a task already sits in the ptrace stop the seize's
    PTRACE_INTERRUPT asked for, and that trap is still to come: resumed, it would take it
    before the work. FORK says EAGAIN at once, nothing resumed; once a resume has let it take
    the trap, the same call forks. Let go, the source is stopped again, as it was."""
    src = looper.pid
    os.kill(src, signal.SIGSTOP)
    read_until(Path(f"/proc/{src}/status"), lambda t: "\nState:\tT (stopped)" in t)
    kids = []
    try:
        seize(src)
        t = time.monotonic()
        assert errno_of(dev.fork, src, [(ns, 0, 0)]) == errno.EAGAIN
        assert time.monotonic() - t < 1  # not fork_timeout_ms
        _ptrace(PTRACE_CONT, src)
        event_stop(src)  # at once: no user instruction ran
        req, kids = dev.fork(src, [(ns, 0, 0)])
        assert req.done == 1
        event_stop(src)
        event_stop(kids[0])
        vpid = int(status(kids[0])["NSpid"][-1])
        _ptrace(PTRACE_DETACH, kids[0])
        line = read_until(looper.out / str(vpid), lambda t: t.endswith("\n")).split()
        assert line[1] == "1" and line[3] == looper.marker
        n = looper_count(looper)
        _ptrace(PTRACE_DETACH, src)
        read_until(Path(f"/proc/{src}/status"), lambda t: "\nState:\tT (stopped)" in t)
        time.sleep(0.3)
        assert looper_count(looper) == n
        os.kill(src, signal.SIGCONT)
        runs_on(looper, n)
    finally:
        kill_all(kids)


# The init of a world of its own: new pid, mount, net, ipc and uts namespaces, a root and a
# directory of its own (argv[1], argv[1]/sub), a hostname and a umask; prints its host pid.
WORLD = r"""
import ctypes, os, socket, sys, time
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x20000000 | 0x00020000 | 0x40000000 | 0x08000000 | 0x04000000):
    raise OSError(ctypes.get_errno(), "unshare")
pid = os.fork()
if pid == 0:
    if libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None):  # MS_REC | MS_PRIVATE
        raise OSError(ctypes.get_errno(), "mount")
    os.chroot(sys.argv[1])
    os.chdir("/sub")
    socket.sethostname("in-parent")
    os.umask(0o077)
    os.write(1, b"ready\n")
    while True:
        try:
            os.wait()
        except ChildProcessError:
            time.sleep(0.05)
print(pid, flush=True)
os.waitpid(pid, 0)
"""


@pytest.fixture
def world(tmp_path):
    (tmp_path / "root" / "sub").mkdir(parents=True)
    p = subprocess.Popen([sys.executable, "-c", WORLD, str(tmp_path / "root")],
                         stdout=subprocess.PIPE, text=True)
    # the child's "ready" and its parent's print of its pid race: either comes first
    lines = sorted([p.stdout.readline(), p.stdout.readline()])
    assert lines[1] == "ready\n", lines
    init = int(lines[0])
    yield init
    kill_all([init])
    p.wait(timeout=30)


def test_fork_in_parent_makes_the_child_in_its_parents_world(dev, looper, frozen_cgroup, world):
    """IN_PARENT: the child has its parent's namespaces, root, directory and cgroup (what
    setns, chdir and a cgroup.procs write would give it), and the source's own umask; the
    source keeps its own world."""
    (frozen_cgroup / "cgroup.procs").write_text(str(world))
    src = looper.pid
    seize(src)
    kids = []
    try:
        req, kids = dev.fork(src, [(world, 0, world), (world, 0, 0)], flags=ABI.BUNSHIN_FORK_IN_PARENT)
        assert req.done == 2
        event_stop(src)
        for k in kids:
            event_stop(k)
            for ns in ("mnt", "net", "ipc", "uts", "pid", "cgroup"):
                assert os.readlink(f"/proc/{k}/ns/{ns}") == os.readlink(f"/proc/{world}/ns/{ns}"), ns
            assert os.readlink(f"/proc/{k}/root") == os.readlink(f"/proc/{world}/root")
            assert os.readlink(f"/proc/{k}/cwd") == os.readlink(f"/proc/{world}/cwd")
            assert Path(f"/proc/{k}/cgroup").read_text() == Path(f"/proc/{world}/cgroup").read_text()
            assert status(k)["Umask"] == status(src)["Umask"] != status(world)["Umask"]
            assert status(k)["PPid"] == [str(world)]
        assert str(k) in (frozen_cgroup / "cgroup.procs").read_text().split()
        for ns in ("mnt", "net", "uts"):
            assert os.readlink(f"/proc/{src}/ns/{ns}") != os.readlink(f"/proc/{world}/ns/{ns}")
        assert os.readlink(f"/proc/{src}/root") == "/"
        assert Path(f"/proc/{src}/cgroup").read_text() != Path(f"/proc/{world}/cgroup").read_text()
        _ptrace(PTRACE_DETACH, src)
        runs_on(looper)
    finally:
        kill_all(kids, traced=True)


# A process of the namespace whose pid is argv[1]'s that unshared CLONE_NEWPID: its children
# would get their pids in another; prints its host pid.
UNSHARED = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
if libc.setns(os.open(f"/proc/{sys.argv[1]}/ns/pid", os.O_RDONLY), 0x20000000):
    raise OSError(ctypes.get_errno(), "setns")
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    if libc.unshare(0x20000000):
        raise OSError(ctypes.get_errno(), "unshare")
    os.write(w, b"x")
    time.sleep(1000)
    os._exit(0)
os.read(r, 1)
print(pid, flush=True)
os.waitpid(pid, 0)
"""


def test_fork_in_parent_needs_the_childs_pid_namespace_for_children(dev, looper, ns):
    """A parent whose new children would get their pids elsewhere (it unshared CLONE_NEWPID
    after its own birth) has no world a child of this namespace can share: EXDEV, found by
    the source at its work (resumed), nothing made."""
    inner = subprocess.Popen([sys.executable, "-c", UNSHARED, str(ns)], stdout=subprocess.PIPE, text=True)
    parent = int(inner.stdout.readline())
    try:
        seize(looper.pid)
        with pytest.raises(OSError) as e:
            dev.fork(looper.pid, [(ns, 0, parent)], flags=ABI.BUNSHIN_FORK_IN_PARENT)
        assert e.value.errno == errno.EXDEV and e.value.resumed and e.value.made == []
        event_stop(looper.pid)
        _ptrace(PTRACE_DETACH, looper.pid)
    finally:
        kill_all([parent, inner.pid])
        inner.wait()


def test_fork_needs_privilege(dev, looper):
    assert errno_as_nobody(f"fork({looper.pid}, [(0, 0, 0)])") == errno.EPERM
    # CAP_CHECKPOINT_RESTORE is enough to fork (refused next: not its tracee), not to fork
    # into another task's namespaces
    assert errno_without_cap(f"fork({looper.pid}, [(0, 0, 0)])", "sys_admin") == errno.EBUSY
    assert errno_without_cap(f"fork({looper.pid}, [(0, 0, 0)], flags={ABI.BUNSHIN_FORK_IN_PARENT})",
                             "sys_admin") == errno.EPERM


@pytest.fixture
def frozen_cgroup():
    """A cgroup v2 directory (the hierarchy mounted if the guest has none yet)."""
    root = Path("/sys/fs/cgroup")
    if not (root / "cgroup.controllers").exists():
        subprocess.run(["mount", "-t", "cgroup2", "cgroup2", str(root)], check=True)
    cg = root / f"fork-verb-{os.getpid()}"
    cg.mkdir()
    yield cg
    (cg / "cgroup.freeze").write_text("0")
    for _ in range(200):
        try:
            cg.rmdir()
            break
        except OSError:
            time.sleep(0.05)


def test_fork_in_a_source_the_freezer_wants(dev, ns, looper, frozen_cgroup):
    """A source frozen by the cgroup v2 freezer while it sits in its ptrace stop cannot fork
    (copy_process refuses while a trap is pending): nothing is made, the call says EAGAIN (or
    ETIMEDOUT if the source never got to the work) and the source stops again for us, so it
    never runs on unseen; thawed and let go, it carries on."""
    (frozen_cgroup / "cgroup.procs").write_text(str(looper.pid))
    seize(looper.pid)
    (frozen_cgroup / "cgroup.freeze").write_text("1")
    t = time.monotonic()
    with pytest.raises(OSError) as e:
        dev.fork(looper.pid, [(ns, 0, 0)])
    took = time.monotonic() - t
    assert e.value.errno in (errno.EAGAIN, errno.ETIMEDOUT), (e.value, took)
    assert e.value.resumed and e.value.made == []
    event_stop(looper.pid)
    (frozen_cgroup / "cgroup.freeze").write_text("0")
    n = looper_count(looper)
    time.sleep(0.3)
    assert looper_count(looper) == n  # stopped: ours until we let go
    _ptrace(PTRACE_DETACH, looper.pid)
    runs_on(looper, n)
    assert [p for p in os.listdir("/proc") if p.isdigit()
            and status(int(p)).get("PPid") == [str(ns)]] == []  # no child appeared
    print(f"frozen source: {e.value.strerror} after {took:.3f} s")


@pytest.fixture
def no_patience():
    """FORK's timeout at 0: each call gives up at once, racing the source to its work."""
    knob = Path("/sys/module/bunshin/parameters/fork_timeout_ms")
    old = knob.read_text().strip()
    knob.write_text("0")
    yield
    knob.write_text(old)


def test_fork_that_gives_up_takes_its_work_back(dev, ns, looper, no_patience):
    """With no time to wait, a call either finds the work done (children made, as usual) or
    takes it back before the source runs it (ETIMEDOUT, nothing made); either way the source
    stops again for us and nothing else is left behind."""
    pid = looper.pid
    seize(pid)
    outcomes = {"made": 0, "taken back": 0}
    kids = []
    try:
        for _ in range(30):
            try:
                _, made = dev.fork(pid, [(ns, 0, 0)])
            except OSError as e:
                assert e.errno == errno.ETIMEDOUT and e.resumed and e.made == [], e
                outcomes["taken back"] += 1
                event_stop(pid)
                continue
            outcomes["made"] += 1
            event_stop(pid)
            event_stop(made[0])
            kids += made
            assert status(made[0])["PPid"] == [str(ns)]
        print(f"no patience: {outcomes}")
        _ptrace(PTRACE_DETACH, pid)
        runs_on(looper)
        left = sorted(int(p) for p in os.listdir("/proc") if p.isdigit()
                      and status(int(p)).get("PPid") == [str(ns)])
        assert left == sorted(kids)  # only the children the calls reported
    finally:
        kill_all(kids, traced=True)
