"""bunshin.ko in a real guest kernel: GET_VERSION and SHARE_STATS.

SHARE_STATS answers are compared exactly with pagemap_walk.py, the same
count done in user space while the processes are stopped.
"""
import ctypes
import errno
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import uapi
from conftest import errno_as_nobody

if not os.path.exists(uapi.DEVICE):
    pytest.skip("bunshin.ko is not loaded; kmod/tests/run.sh runs these tests in a guest",
                allow_module_level=True)

# after the skip: pagemap_walk needs numpy, present wherever the module runs
import pagemap_walk
from uapi import ABI

PAGE = os.sysconf("SC_PAGE_SIZE")
HERE = Path(__file__).resolve().parent
FAMILY_SIZE = 64 << 20
CHILDREN = 3


def errno_of(fn, *args, **kwargs):
    with pytest.raises(OSError) as e:
        fn(*args, **kwargs)
    return e.value.errno


def kernel_stats(dev, pids):
    req, stats = dev.share_stats(pids)
    check_invariants(req, stats)
    per_pid = {s.pid: {"mapped": s.mapped_pages, "shared": s.shared_pages,
                       "unique": s.unique_pages} for s in stats}
    assert req.nmms == len(set(pids))
    return per_pid, {"shared": req.shared_pages, "total": req.total_pages}


def check_invariants(req, stats):
    """Every distinct page is either shared or unique to exactly one mm."""
    members = {s.mm_slot: s for s in stats}
    assert len(members) == req.nmms
    assert req.total_pages == req.shared_pages + sum(s.unique_pages for s in members.values())
    for s in stats:
        assert s.mapped_pages >= s.shared_pages + s.unique_pages
        assert s.shared_pages <= req.shared_pages
        assert list(s.reserved) == [0] * len(s.reserved)
    assert list(req.reserved) == [0] * len(req.reserved)


def agreed_stats(dev, *groups):
    """Kernel answer for the stopped processes of groups, checked against the
    pagemap walk.  Two kernel walks around the user walk must match first:
    if they differ, the kernel moved pages behind the stopped processes
    (reclaim, compaction) and the comparison is retried."""
    pids = [pid for g in groups for pid in g.pids]
    for g in groups:
        g.stop()
    try:
        for _ in range(3):
            before = kernel_stats(dev, pids)
            user = pagemap_walk.share_stats(pids)
            after = kernel_stats(dev, pids)
            if before == after:
                break
        assert before == after, "pages of stopped processes kept moving"
        assert before == user
    finally:
        for g in groups:
            g.cont()
    return before


def anon_huge_kib(pid):
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


# --- GET_VERSION and the device ------------------------------------------------

def test_device_is_root_only(dev):
    st = os.stat(uapi.DEVICE)
    assert stat.S_ISCHR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0


def test_get_version_matches_header(dev):
    v = dev.get_version()
    assert v.abi_version == ABI.BUNSHIN_ABI_VERSION
    assert v.features == (ABI.feature(ABI.BUNSHIN_NR_GET_VERSION) | ABI.feature(ABI.BUNSHIN_NR_SHARE_STATS)
                          | ABI.feature(ABI.BUNSHIN_NR_REPARENT) | ABI.feature(ABI.BUNSHIN_NR_GROUP_STATS)
                          | ABI.feature(ABI.BUNSHIN_NR_FORK) | ABI.feature(ABI.BUNSHIN_NR_RUN)
                          | ABI.feature(ABI.BUNSHIN_NR_JOIN_SESSION))
    major, minor, patch = map(int, Path("/sys/module/bunshin/version").read_text().split("."))
    assert (v.module_version >> 16, v.module_version >> 8 & 0xff, v.module_version & 0xff) == \
        (major, minor, patch)
    assert list(v.reserved) == [0] * len(v.reserved)


def test_get_version_rejects_reserved(dev):
    assert errno_of(dev.get_version, reserved=1) == errno.EINVAL


@pytest.mark.parametrize("cmd", [
    "_IOWR(BUNSHIN_IOC_MAGIC, 2, struct bunshin_version)",             # reserved: REPARENT
    "_IOWR(BUNSHIN_IOC_MAGIC, BUNSHIN_NR_GET_VERSION, struct bunshin_share_stats)",  # wrong size
])
def test_unknown_command_enotty(dev, cmd):
    import fcntl
    buf = bytearray(256)
    assert errno_of(fcntl.ioctl, dev.fd, ABI.value(cmd), buf, True) == errno.ENOTTY


def test_reference_counters_move(dev):
    before = uapi.refs()
    dev.share_stats([os.getpid()])
    after = uapi.refs()
    for kind in ("task", "mm", "pfns"):
        assert after[kind][0] > before[kind][0], kind


# --- SHARE_STATS on real processes ---------------------------------------------

def test_fork_family_shares_then_diverges(dev, store, victims):
    half = FAMILY_SIZE // PAGE // 2
    fam = victims("family", FAMILY_SIZE, CHILDREN, ready=CHILDREN + 1)
    parent = fam.proc.pid
    children = [p for p in fam.pids if p != parent]
    assert anon_huge_kib(parent) > 0, "no THP: the PMD path would go untested"

    per, total = agreed_stats(dev, fam)
    assert total["shared"] >= 2 * half
    for c in children:
        assert per[c]["unique"] < half // 4
        assert per[c]["shared"] >= 2 * half

    fam.rewrite_half(children)
    per2, total2 = agreed_stats(dev, fam)
    # The first half is now the parent's alone and each child has its own
    # copy.  The interpreters running the rewrite also fault in or copy a
    # few pages of their own, hence the slack.
    slack = half // 8
    assert abs(total["shared"] - total2["shared"] - half) <= slack
    assert per2[parent]["unique"] - per[parent]["unique"] >= half - slack
    for c in children:
        assert per2[c]["unique"] - per[c]["unique"] >= half
        assert per2[c]["mapped"] >= 2 * half


def test_unrelated_processes_share_tmpfs_file(dev, victims):
    path, size = Path(os.environ.get("TMPDIR", "/tmp")) / "bunshin-shared", 8 << 20
    a, b = victims("file", path, size), victims("file", path, size)
    try:
        _, total = agreed_stats(dev, a, b)
    finally:
        path.unlink()
    assert total["shared"] >= size // PAGE


def test_page_mapped_twice_by_one_mm_is_one_page(dev, store, victims):
    path, size = Path(os.environ.get("TMPDIR", "/tmp")) / "bunshin-twice", 4 << 20
    v = victims("file", path, size, "twice")
    try:
        per, total = agreed_stats(dev, v)
    finally:
        path.unlink()
    me = per[v.pids[0]]
    assert me["mapped"] - (me["shared"] + me["unique"]) >= size // PAGE
    assert me["shared"] == total["shared"] == 0


@pytest.fixture
def hugetlbfs(tmp_path):
    nr = Path("/proc/sys/vm/nr_hugepages")
    old = nr.read_text()
    nr.write_text("4")
    subprocess.run(["mount", "-t", "hugetlbfs", "none", str(tmp_path)], check=True)
    yield tmp_path
    subprocess.run(["umount", str(tmp_path)], check=True)
    nr.write_text(old)


def test_hugetlb_pages_counted(dev, store, hugetlbfs, victims):  # victims go before the fs
    size = 4 << 20
    a = victims("file", hugetlbfs / "shared", size)
    b = victims("file", hugetlbfs / "shared", size)
    per, total = agreed_stats(dev, a, b)
    assert total["shared"] >= size // PAGE
    assert per[a.pids[0]]["mapped"] >= size // PAGE


def test_zero_pages_not_counted(dev, store, victims):
    size = 8 << 20
    v = victims("zero", size)
    v.stop()
    try:
        zeros = pagemap_walk.zero_entries(v.pids[0])
    finally:
        v.cont()
    assert zeros >= size // PAGE // 2, "the victim maps no zero pages to exclude"
    agreed_stats(dev, v)


def test_threads_and_repeated_pids_are_one_mm(dev):
    done = threading.Event()
    t = threading.Thread(target=done.wait)
    t.start()
    try:
        pids = [os.getpid(), t.native_id, os.getpid()]
        req, stats = dev.share_stats(pids)
    finally:
        done.set()
        t.join()
    assert req.nmms == 1 and req.shared_pages == 0
    assert [s.pid for s in stats] == pids
    assert [s.mm_slot for s in stats] == [0, 0, 0]
    for s in stats:
        assert s.unique_pages == req.total_pages and s.shared_pages == 0
        assert s.mapped_pages >= s.unique_pages > 0


def test_pids_exiting_during_concurrent_calls(dev):
    """Processes die while two threads query them: each call either counts
    them or fails with ESRCH, and no reference is left behind."""
    errors = []

    def query(pids):
        for _ in range(5):
            try:
                dev.share_stats(pids)
            except OSError as e:
                errors.append(e.errno)

    for _ in range(8):
        procs = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
        pids = [p.pid for p in procs] + [os.getpid()]
        threads = [threading.Thread(target=query, args=(pids,)) for _ in range(2)]
        for t in threads:
            t.start()
        for p in procs:
            p.kill()
        for t in threads:
            t.join()
        for p in procs:
            p.wait()
    assert set(errors) <= {errno.ESRCH}
    assert errno.ESRCH in errors, "no call saw a process vanish"


def test_concurrent_calls_agree_with_lone_calls(dev, victims):
    """The pfn array the module keeps between calls serves one call at a time; a call racing
    it counts in one of its own. Every answer equals a lone call's: nothing one call set in
    the array is seen by the next."""
    a = victims("family", 8 << 20, 2, ready=3)
    b = victims("family", 4 << 20, 1, ready=2)
    a.stop()
    b.stop()
    try:
        sets = [tuple(a.pids), tuple(b.pids), tuple(a.pids + b.pids), tuple(b.pids[:1])]
        alone = {s: kernel_stats(dev, list(s)) for s in sets}
        seen = []

        def query(order):
            for _ in range(15):
                for s in order:
                    seen.append((s, kernel_stats(dev, list(s))))

        threads = [threading.Thread(target=query, args=(sets[i:] + sets[:i],)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if alone != {s: kernel_stats(dev, list(s)) for s in sets}:
            pytest.skip("pages of the stopped processes moved meanwhile (reclaim or compaction)")
        assert len(seen) == 3 * 15 * len(sets)
        wrong = [(s, got) for s, got in seen if got != alone[s]]
        assert not wrong, wrong[:2]
    finally:
        a.cont()
        b.cont()


def user_pids():
    """Every process with an address space (kernel threads have none)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "exe"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def test_every_process_in_the_guest(dev):
    extra = [subprocess.Popen(["sleep", "100"]) for _ in range(2)]  # whatever else runs
    try:
        for _ in range(10):
            try:
                pids = user_pids()
                req, stats = dev.share_stats(pids)
            except ProcessLookupError:
                continue  # one exited between listing and the call
            if req.nmms == len(stats):
                break
            time.sleep(0.05)  # a vfork child shares its parent's mm until it execs
    finally:
        for p in extra:
            p.kill()
            p.wait()
    check_invariants(req, stats)
    assert req.nmms == len(stats) > 3 and req.shared_pages > 0, pids


# --- bad input -------------------------------------------------------------------

@pytest.mark.parametrize("override,err", [
    ({"npids": 0}, errno.EINVAL),
    ({"npids": ABI.BUNSHIN_SHARE_STATS_MAX_PIDS + 1}, errno.E2BIG),
    ({"npids": 1 << 31}, errno.E2BIG),
    ({"flags": 1}, errno.EINVAL),
    ({"reserved": 1}, errno.EINVAL),
    ({"stats_size": 8}, errno.EINVAL),
    ({"pids_ptr": 8}, errno.EFAULT),
    ({"pids_ptr": 0xffff888000000000}, errno.EFAULT),
    ({"stats_ptr": 8}, errno.EFAULT),
], ids=lambda x: str(x))
def test_bad_request(dev, override, err):
    assert errno_of(dev.share_stats, [os.getpid()], **override) == err


@pytest.mark.parametrize("cmd", ["BUNSHIN_IOC_GET_VERSION", "BUNSHIN_IOC_SHARE_STATS"])
def test_null_argument_efault(dev, cmd):
    import fcntl
    assert errno_of(fcntl.ioctl, dev.fd, ABI.value(cmd), 0) == errno.EFAULT


def test_read_only_request_efault_after_walk(dev):
    """The walk succeeds but the answer cannot be written back: EFAULT, and
    everything the walk held is released."""
    import ctypes
    import mmap
    pids = (ctypes.c_int32 * 1)(os.getpid())
    stats = (ABI.bunshin_pid_stats * 1)()
    req = ABI.bunshin_share_stats(pids_ptr=ctypes.addressof(pids), stats_ptr=ctypes.addressof(stats),
                                  npids=1, stats_size=ctypes.sizeof(ABI.bunshin_pid_stats))
    page = mmap.mmap(-1, PAGE)
    page[:ctypes.sizeof(req)] = bytes(req)
    view = ctypes.c_char.from_buffer(page)
    addr = ctypes.addressof(view)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(addr), PAGE, mmap.PROT_READ) == 0
    try:
        # fcntl.ioctl takes a C int argument, too small for an address
        rc = libc.ioctl(dev.fd, ctypes.c_ulong(ABI.BUNSHIN_IOC_SHARE_STATS), ctypes.c_void_p(addr))
        assert (rc, ctypes.get_errno()) == (-1, errno.EFAULT)
        assert stats[0].pid == os.getpid()  # the per-pid array was written first
    finally:
        libc.mprotect(ctypes.c_void_p(addr), PAGE, mmap.PROT_READ | mmap.PROT_WRITE)
        del view
        page.close()


@pytest.mark.parametrize("pid", [0, -1])
def test_nonpositive_pid_einval(dev, pid):
    assert errno_of(dev.share_stats, [os.getpid(), pid]) == errno.EINVAL


def test_reaped_pid_esrch(dev):
    p = subprocess.Popen(["true"])
    p.wait()
    assert errno_of(dev.share_stats, [os.getpid(), p.pid]) == errno.ESRCH


def test_zombie_esrch(dev):
    p = subprocess.Popen(["true"])
    os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
    try:
        assert errno_of(dev.share_stats, [p.pid]) == errno.ESRCH
    finally:
        p.wait()


def test_kernel_thread_esrch(dev):
    assert Path("/proc/2/comm").read_text().strip() == "kthreadd"
    assert errno_of(dev.share_stats, [2]) == errno.ESRCH


# A child with a reduced capability set opens the device (it is uid 0, the
# owner) and reports the errno of one SHARE_STATS call, 0 for success; pid 0
# stands for the child itself, which passes the ptrace check by definition.
PROBE = """
import os, sys, uapi
try:
    uapi.Device().share_stats([int(sys.argv[1]) or os.getpid()])
    print(0)
except OSError as e:
    print(e.errno)
"""


def limited_errno(caps, pid):
    out = subprocess.run(["setpriv", f"--bounding-set=-all{caps}", "--inh-caps=-all",
                          sys.executable, "-c", PROBE, str(pid)],
                         cwd=HERE, capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_no_capability_eperm():
    assert limited_errno("", 0) == errno.EPERM
    assert limited_errno(",+sys_ptrace", 0) == errno.EPERM
    assert limited_errno(",+checkpoint_restore", 0) == 0
    assert limited_errno(",+sys_admin", 0) == 0


def test_no_ptrace_access_eperm():
    other = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                              "sleep", "600"])
    try:
        while Path(f"/proc/{other.pid}/status").read_text().find("Uid:\t65534") < 0:
            time.sleep(0.01)
        assert limited_errno(",+sys_admin", other.pid) == errno.EPERM
        assert limited_errno(",+sys_admin,+sys_ptrace", other.pid) == 0
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()


def test_library_sees_the_module_and_its_abi():
    """The library side: bunshin reads GET_VERSION through the same uapi header (compiled into
    bunshin._core) and doctor's probes report the module's ABI."""
    code = ("from bunshin import kerndat; from bunshin._core import _kmod; "
            "print(kerndat._bunshin_module_version(), _kmod.ABI_VERSION)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    want = str(ABI.BUNSHIN_ABI_VERSION)  # parsed from the header text itself
    assert r.stdout.split() == [want, want]


# -- REPARENT ---------------------------------------------------------------------------------

ADOPTER = r"""
import os, sys
print(os.getpid(), flush=True)
sys.stdin.readline()                 # told: a child has been moved under us
pid, status = os.wait()              # we can wait for a process we never forked
print(pid, os.waitstatus_to_exitcode(status), flush=True)
"""


def _ppid(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise KeyError(pid)


def _adopter_reaps(adopter, child):
    """``child`` is no longer ours: the ADOPTER script waits for it and reports its death."""
    with pytest.raises(ChildProcessError):
        os.waitpid(child.pid, os.WNOHANG)
    os.kill(child.pid, signal.SIGTERM)
    adopter.stdin.write("go\n")
    adopter.stdin.flush()
    pid, code = adopter.stdout.readline().split()
    assert int(pid) == child.pid and int(code) == -signal.SIGTERM


def _stop_adoption(adopter, child):
    for p in (child, adopter):
        if p.poll() is None:
            p.kill()
    adopter.wait()
    child.returncode = 0  # reaped by the adopter


def test_reparent_moves_a_process_and_its_threads(dev):
    adopter = subprocess.Popen([sys.executable, "-c", ADOPTER], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    child = subprocess.Popen([sys.executable, "-c",
                              "import threading, time\n"
                              "[threading.Thread(target=time.sleep, args=(100,), daemon=True).start() for _ in range(3)]\n"
                              "time.sleep(100)"])
    try:
        new_parent = int(adopter.stdout.readline())
        time.sleep(0.3)
        req = dev.reparent(child.pid, new_parent)
        assert req.old_parent == os.getpid()
        assert _ppid(child.pid) == new_parent
        for tid in os.listdir(f"/proc/{child.pid}/task"):
            assert _ppid(int(tid)) == new_parent  # every thread follows the leader
        _adopter_reaps(adopter, child)
    finally:
        _stop_adoption(adopter, child)


def test_reparent_bad_input(dev):
    a = subprocess.Popen(["sleep", "100"])
    b = subprocess.Popen(["sleep", "100"])
    try:
        assert errno_of(dev.reparent, a.pid, b.pid, flags=2) == errno.EINVAL
        # TRACED says the caller traces pid: it does not
        assert errno_of(dev.reparent, a.pid, b.pid,
                        flags=ABI.BUNSHIN_REPARENT_TRACED) == errno.EBUSY
        assert errno_of(dev.reparent, a.pid, b.pid, reserved=1) == errno.EINVAL
        assert errno_of(dev.reparent, a.pid, a.pid) == errno.EINVAL
        # a cycle: our own parent cannot become a child of our child
        assert errno_of(dev.reparent, os.getpid(), a.pid) == errno.EINVAL
        dead = subprocess.Popen(["true"])
        dead.wait()
        assert errno_of(dev.reparent, dead.pid, a.pid) == errno.ESRCH
        assert errno_of(dev.reparent, a.pid, dead.pid) == errno.ESRCH
        assert _ppid(a.pid) == os.getpid()  # nothing moved
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_reparent_needs_privilege(dev):
    a = subprocess.Popen(["sleep", "100"])
    b = subprocess.Popen(["sleep", "100"])
    try:
        assert errno_as_nobody(f"reparent({a.pid}, {b.pid})") == errno.EPERM
        assert _ppid(a.pid) == os.getpid()
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
PTRACE_DETACH, PTRACE_SEIZE, PTRACE_INTERRUPT = 17, 0x4206, 0x4207


def _ptrace(req, pid, data=0):
    if libc.ptrace(req, pid, None, ctypes.c_void_p(data)) < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def test_reparent_traced_moves_only_the_real_parent(dev):
    """A clone made by injection is traced by the engine until its fixups are done: its real
    parent moves while the caller stays its tracer, and it runs under the new parent only."""
    adopter = subprocess.Popen([sys.executable, "-c", ADOPTER], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    child = subprocess.Popen(["sleep", "100"])
    try:
        new_parent = int(adopter.stdout.readline())
        _ptrace(PTRACE_SEIZE, child.pid)
        _ptrace(PTRACE_INTERRUPT, child.pid)
        os.waitpid(child.pid, 0x40000000)  # __WALL: the interrupt stop
        assert errno_of(dev.reparent, child.pid, new_parent) == errno.EBUSY
        req = dev.reparent(child.pid, new_parent, flags=ABI.BUNSHIN_REPARENT_TRACED)
        assert req.old_parent == os.getpid()
        status = Path(f"/proc/{child.pid}/status").read_text()
        assert f"\nPPid:\t{new_parent}\n" in status and f"\nTracerPid:\t{os.getpid()}\n" in status
        # a thread that is not the tracer may not
        box = []
        t = threading.Thread(target=lambda: box.append(
            errno_of(dev.reparent, child.pid, os.getpid(), flags=ABI.BUNSHIN_REPARENT_TRACED)))
        t.start()
        t.join()
        assert box == [errno.EBUSY]
        _ptrace(PTRACE_DETACH, child.pid)
        assert _ppid(child.pid) == new_parent
        _adopter_reaps(adopter, child)
    finally:
        _stop_adoption(adopter, child)


# -- GROUP_STATS ----------------------------------------------------------------------------

def test_group_stats_match_pagemap_and_share_stats(dev, store, victims):
    fam = victims("family", FAMILY_SIZE, CHILDREN, ready=CHILDREN + 1)
    parent = fam.proc.pid
    children = [p for p in fam.pids if p != parent]
    fam.rewrite_half(children[:1])
    pids = [parent, *children]
    groups = [0, 0, 1, 2]  # the parent and its first child are one workspace
    fam.stop()
    try:
        for _ in range(3):
            req, st = dev.group_stats(pids, groups)
            user = pagemap_walk.group_stats(pids, groups)
            req2, st2 = dev.group_stats(pids, groups)
            kernel = {g: {"mapped": s.mapped_pages, "distinct": s.distinct_pages,
                          "shared": s.shared_pages} for g, s in enumerate(st)}
            if [bytes(x) for x in st] == [bytes(x) for x in st2]:
                break
        assert (kernel, {"shared": req.shared_pages, "total": req.total_pages}) == user
        assert req.nmms == 4 and [s.nmms for s in st] == [2, 1, 1]
        # one group per pid is SHARE_STATS
        sreq, sst = dev.share_stats(pids)
        oreq, ost = dev.group_stats(pids, range(4))
        assert (oreq.shared_pages, oreq.total_pages) == (sreq.shared_pages, sreq.total_pages)
        assert [(g.distinct_pages - g.shared_pages, g.shared_pages) for g in ost] == \
            [(s.unique_pages, s.shared_pages) for s in sst]
        # pages the parent shares only with its first child are private to group 0
        assert st[0].distinct_pages - st[0].shared_pages > \
            sst[0].unique_pages + sst[1].unique_pages
    finally:
        fam.cont()


def test_group_stats_bad_input(dev):
    me = os.getpid()
    assert errno_of(dev.group_stats, [me], [0], ngroups=0) == errno.EINVAL
    assert errno_of(dev.group_stats, [me], [1], ngroups=1) == errno.EINVAL
    assert errno_of(dev.group_stats, [me], [0], ngroups=2) == errno.EINVAL  # more groups than pids
    assert errno_of(dev.group_stats, [me, me], [0, 1]) == errno.EINVAL  # one mm, two groups
    assert errno_of(dev.group_stats, [me], [0], flags=1) == errno.EINVAL
    assert errno_of(dev.group_stats, [me], [0], pad=1) == errno.EINVAL
    assert errno_of(dev.group_stats, [me], [0], reserved=1) == errno.EINVAL
    assert errno_of(dev.group_stats, [me], [0], stats_size=8) == errno.EINVAL
    assert errno_of(dev.group_stats, [me], [0], groups_ptr=8) == errno.EFAULT
    assert errno_of(dev.group_stats, [me], [0], stats_ptr=8) == errno.EFAULT
    assert errno_of(dev.group_stats, [0x3fffffff], [0]) == errno.ESRCH
    req, st = dev.group_stats([me, me], [1, 1], ngroups=2)  # an empty group reads as zeros
    assert bytes(st[0]) == bytes(len(bytes(st[0]))) and st[1].distinct_pages > 0
