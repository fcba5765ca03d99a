"""bunshin.memory against real fork families: a python3 victim touches memory and os.fork()s
children; the figures are checked against the victim's own layout, against the kernel's Pss,
and against a pure-Python reading of /proc/PID/pagemap. Every process started is killed.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from bunshin.errors import BunshinError
from bunshin.memory import (
    AccountingError,
    family_usage,
    pagemap,
    pids_usage,
    process_pfns,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="PFNs in /proc/PID/pagemap need root")

MiB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
BACKENDS = ["0", "", "all"]  # BUNSHIN_PAGEMAP_SCAN: plain reads, auto, PAGEMAP_SCAN everywhere

# Touches N MiB of private anonymous memory, forks K children that share it, prints their pids.
# A byte "k" on stdin makes child k rewrite its copy (it answers "rewrote k" on stdout).
FAMILY = r"""
import mmap, os, sys
n, k = int(sys.argv[1]) << 20, int(sys.argv[2])
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in range(0, n, 4096):
    m[i] = 1
kids = []
for j in range(k):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        while os.read(r, 1):
            for i in range(0, n, 4096):
                m[i] = 2
            os.write(1, b"rewrote %d\n" % j)
        os._exit(0)
    os.close(r)
    kids.append((pid, w))
os.write(1, (" ".join(str(p) for p, _ in kids) + "\n").encode())
while c := os.read(0, 1):
    os.write(kids[int(c)][1], b"w")
"""


@contextmanager
def fork_family(mib: int, kids: int):
    """(proc, [parent pid, child pids...]) of a running FAMILY victim."""
    proc = subprocess.Popen([sys.executable, "-c", FAMILY, str(mib), str(kids)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    pids = [proc.pid]
    try:
        pids += [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == kids + 1, "the victim did not start its children"
        yield proc, pids
    finally:
        for p in reversed(pids):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def rewrite(proc: subprocess.Popen, kid: int) -> None:
    proc.stdin.write(str(kid).encode())
    proc.stdin.flush()
    assert proc.stdout.readline() == b"rewrote %d\n" % kid


@contextmanager
def stopped(pids):
    """Freeze processes so that two readings of their page tables can be compared."""
    for p in pids:
        os.kill(p, signal.SIGSTOP)
    try:
        for p in pids:  # SIGSTOP is asynchronous: wait until each is really stopped
            while Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
                time.sleep(0.001)
        yield
    finally:
        for p in pids:
            os.kill(p, signal.SIGCONT)


def rollup(pid: int) -> dict[str, int]:
    """/proc/PID/smaps_rollup in bytes: {"Rss": ..., "Pss": ..., "AnonHugePages": ...}."""
    lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in lines if l.endswith(" kB")}


def reference_pfns(pid: int) -> list[int]:
    """Present PFNs of pid in address order, the slow obvious way (struct, one entry at a time)."""
    zero, hz_lo, hz_hi = pagemap.zero_pfns()
    out = []
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/pagemap", "rb", buffering=0) as pm:
        for line in maps:
            if line.rstrip().endswith("[vsyscall]"):
                continue
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            data = os.pread(pm.fileno(), (hi - lo) // PAGE * 8, lo // PAGE * 8)
            for (e,) in struct.iter_unpack("<Q", data):
                pfn = e & ((1 << 55) - 1)
                if e >> 63 and pfn != zero and not hz_lo <= pfn < hz_hi:
                    out.append(pfn)
    return out


def reference_usage(groups: dict[str, list[int]]) -> dict[str, tuple[int, int]]:
    """{label: (rss pages, shared pages)} and (total, shared) under "", with Python sets."""
    sets = {g: set().union(*(reference_pfns(p) for p in pids)) for g, pids in groups.items()}
    out = {}
    for g, s in sets.items():
        others = set().union(*(o for h, o in sets.items() if h != g))
        out[g] = (len(s), len(s & others))
    every = [p for s in sets.values() for p in s]
    out[""] = (len(set(every)), sum(1 for c in np.unique(every, return_counts=True)[1] if c > 1))
    return out


@pytest.fixture(params=BACKENDS, ids=["read", "auto", "scan"])
def backend(request, monkeypatch):
    if request.param == "all" and not pagemap.scan_supported():
        pytest.skip("this kernel has no PAGEMAP_SCAN")
    monkeypatch.setenv("BUNSHIN_PAGEMAP_SCAN", request.param)
    return request.param


def test_hot_loop_matches_reference(backend):
    with fork_family(8, 2) as (_, pids), stopped(pids):
        ref = reference_pfns(pids[0])
        got = pagemap.read_pfns(pids[0])
        assert got.dtype == np.uint64 and got.tolist() == ref
        assert process_pfns(pids[0]).tolist() == sorted(set(ref))
        assert len(ref) * PAGE >= 8 * MiB


def test_family_counts_match_reference(backend):
    with fork_family(8, 3) as (_, pids), stopped(pids):
        groups = {"a": [pids[0]], "b": pids[1:3], "c": [pids[3]]}
        u = pids_usage(groups, pss=False)
        ref = reference_usage(groups)
    assert (u.total_bytes, u.shared_bytes) == tuple(x * PAGE for x in ref[""])
    for g in groups:
        w = u.per_workspace[g]
        assert (w.rss_bytes, w.shared_bytes) == tuple(x * PAGE for x in ref[g])
        assert w.private_bytes == w.rss_bytes - w.shared_bytes and w.pss_bytes is None
    assert u.pss_bytes is None


def test_fork_family_shares_then_diverges(backend):
    with fork_family(128, 3) as (proc, pids):
        groups = {f"p{i}": [p] for i, p in enumerate(pids)}
        u = pids_usage(groups)
        assert 128 * MiB <= u.total_bytes < 128 * MiB + 48 * MiB
        assert 128 * MiB <= u.shared_bytes <= u.total_bytes
        for g, w in u.per_workspace.items():
            assert w.private_bytes < 16 * MiB, (g, w)
            assert w.shared_bytes >= 128 * MiB and w.rss_bytes == w.private_bytes + w.shared_bytes
            assert 32 * MiB <= w.pss_bytes < 32 * MiB + 16 * MiB, (g, w)
        assert u.pss_bytes == sum(w.pss_bytes for w in u.per_workspace.values())
        # Pss splits each page over its mappers, so over a family it sums to the distinct pages,
        # less what processes outside the family (this test's own python3) take of shared files
        assert abs(u.pss_bytes - u.total_bytes) < max(16 * MiB, u.total_bytes // 20), u

        rewrite(proc, 1)
        v = pids_usage(groups)
        grew = v.per_workspace["p2"].private_bytes - u.per_workspace["p2"].private_bytes
        assert 127 * MiB <= grew < 132 * MiB, grew
        assert 127 * MiB <= v.total_bytes - u.total_bytes < 132 * MiB
        assert v.per_workspace["p2"].pss_bytes >= 128 * MiB
        # the old copy is still shared by the other three
        for g in ("p0", "p1", "p3"):
            assert v.per_workspace[g].shared_bytes >= 128 * MiB
            assert abs(v.per_workspace[g].private_bytes - u.per_workspace[g].private_bytes) < 4 * MiB
        assert abs(v.pss_bytes - v.total_bytes) < max(16 * MiB, v.total_bytes // 20), v


def test_one_group_per_workspace_not_per_process():
    with fork_family(32, 3) as (_, pids):
        u = pids_usage({"all": pids})
        w = u.per_workspace["all"]
        assert w.shared_bytes == 0 and u.shared_bytes == 0
        assert w.rss_bytes == u.total_bytes and 32 * MiB <= w.rss_bytes < 80 * MiB
        # the same pages counted per process would be four times as many
        assert sum(process_pfns(p).size for p in pids) * PAGE > 3 * w.rss_bytes


@pytest.mark.parametrize("huge", [False, True], ids=["4k", "thp"])
def test_zero_page_is_not_counted(huge):
    zero, hz_lo, hz_hi = pagemap.zero_pfns()
    if huge and hz_lo == hz_hi:
        pytest.skip("no huge zero page here (THP off or use_zero_page=0)")
    code = ("import mmap, sys\nm = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)\n"
            f"{'m.madvise(mmap.MADV_HUGEPAGE)' if huge else ''}\n"
            "s = sum(m[i] for i in range(0, 64 << 20, 4096))\nprint(s, flush=True)\nsys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"0\n"
        mapped = 0
        for line in Path(f"/proc/{p.pid}/maps").read_text().splitlines():
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if hi - lo >= 64 * MiB:
                with open(f"/proc/{p.pid}/pagemap", "rb", buffering=0) as pm:
                    data = os.pread(pm.fileno(), (hi - lo) // PAGE * 8, lo // PAGE * 8)
                pfns = [e & ((1 << 55) - 1) for (e,) in struct.iter_unpack("<Q", data) if e >> 63]
                mapped += sum(1 for f in pfns if f == zero or hz_lo <= f < hz_hi)
        assert mapped * PAGE >= 60 * MiB  # the read really mapped the (huge) zero page
        ours = pids_usage({"x": [p.pid]}).per_workspace["x"]
        # the kernel's Rss leaves the zero page out too; ours agrees with it
        rss_kernel = rollup(p.pid)["Rss"]
        assert ours.rss_bytes < 40 * MiB and abs(ours.rss_bytes - rss_kernel) < 4 * MiB, (ours, rss_kernel)
    finally:
        p.kill()
        p.wait()


def test_huge_pages_count_as_small_pages():
    code = ("import mmap, sys\nm = mmap.mmap(-1, 66 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)\n"
            "m.madvise(mmap.MADV_HUGEPAGE)\nm.write(b'x' * (66 << 20))\nprint('ok', flush=True)\n"
            "sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"ok\n"
        roll = rollup(p.pid)
        if roll["AnonHugePages"] < 32 * MiB:
            pytest.skip("transparent huge pages are not in use here")
        w = pids_usage({"x": [p.pid]}).per_workspace["x"]
        assert 66 * MiB <= w.rss_bytes and abs(w.rss_bytes - roll["Rss"]) < 4 * MiB, (w, roll)
        assert abs(w.pss_bytes - roll["Pss"]) < 1 * MiB
    finally:
        p.kill()
        p.wait()


def test_vanished_and_empty():
    dead = subprocess.Popen(["true"])
    dead.wait()
    with fork_family(8, 1) as (_, pids):
        u = pids_usage({"live": pids, "gone": [dead.pid], "none": []})
        assert u.per_workspace["gone"] == u.per_workspace["none"]
        assert u.per_workspace["gone"].rss_bytes == 0 and u.per_workspace["gone"].pss_bytes == 0
        assert u.per_workspace["live"].rss_bytes == u.total_bytes >= 8 * MiB
        both = pids_usage({"live": pids + [dead.pid]})
        assert abs(both.total_bytes - u.total_bytes) < 1 * MiB
    assert process_pfns(dead.pid).size == 0
    e = pids_usage({})
    assert (e.total_bytes, e.shared_bytes, e.per_workspace, e.pss_bytes) == (0, 0, {}, 0)


@pytest.mark.parametrize("bad", [[1, 2], {"a": 5}, {"a": "12"}, {"a": [0]}, {"a": [-3]},
                                 {"a": [True]}, {"a": ["1"]}, {1: [os.getpid()]}])
def test_bad_groups(bad):
    with pytest.raises(AccountingError) as ei:
        pids_usage(bad)
    assert isinstance(ei.value, BunshinError)


def test_pid_in_two_groups():
    me = os.getpid()
    with pytest.raises(AccountingError, match=f"pid {me} is in both group 'a' and group 'b'"):
        pids_usage({"a": [me], "b": [me]})


def test_bad_workspaces():
    with pytest.raises(AccountingError, match="no .id"):
        family_usage([object()])
    with pytest.raises(AccountingError, match="iterable"):
        family_usage(5)
    with pytest.raises(AccountingError, match="positive int"):
        process_pfns("1")


def test_public_api():
    import bunshin.memory as m

    assert sorted(m.__all__) == sorted(["Usage", "FamilyUsage", "pids_usage", "family_usage",
                                         "process_pfns", "AccountingError"])


HOLD = ("import mmap, time\nm = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)\n"
        "for i in range(0, 64 << 20, 4096):\n    m[i] = 1\nopen('/tmp/held', 'w').write('ok')\n"
        "time.sleep(600)\n")


def _held(ws) -> bool:
    try:
        return ws.read_file("/tmp/held") == b"ok"
    except BunshinError:
        return False


def test_workspaces_attribute_memory(no_leaks):
    import bunshin

    with bunshin.Workspace.create() as ws1, bunshin.Workspace.create() as ws2:
        before = family_usage([ws1, ws2])
        ws1.spawn(["python3", "-c", HOLD])
        deadline = time.monotonic() + 30
        while not _held(ws1):
            assert time.monotonic() < deadline, "the holder did not start"
            time.sleep(0.05)
        u = family_usage([ws1, ws2])
        w1, w2 = u.per_workspace[ws1.id], u.per_workspace[ws2.id]
        assert w1.private_bytes >= 64 * MiB and w1.pss_bytes >= 64 * MiB
        assert w2.private_bytes < 16 * MiB and w2.rss_bytes < 16 * MiB
        assert w2.private_bytes - before.per_workspace[ws2.id].private_bytes < 1 * MiB
        assert u.total_bytes >= 64 * MiB + w2.private_bytes
        labelled = family_usage({"one": ws1, "two": ws2}, pss=False)
        assert set(labelled.per_workspace) == {"one", "two"}
        assert labelled.per_workspace["one"].private_bytes >= 64 * MiB
