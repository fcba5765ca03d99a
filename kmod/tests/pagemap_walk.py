"""SHARE_STATS computed in user space from /proc/PID/pagemap, restricted to a set.

This is the reference the module must agree with: present pagemap entries of
every mapping, minus PFNs /proc/kpageflags marks ZERO_PAGE; a page is shared
when at least two pids of the set map it (unlike /proc/kpagecount, which
counts mappers system-wide).  Needs CAP_SYS_ADMIN to see PFNs.
"""
import os

import numpy as np

from uapi import read_defines

PAGE = os.sysconf("SC_PAGE_SIZE")
# Documentation/admin-guide/mm/pagemap.rst: bit 63 present, bits 0-54 PFN.
PM_PRESENT = np.uint64(1 << 63)
PM_PFN_MASK = np.uint64((1 << 55) - 1)
KPF_ZERO_PAGE = int(read_defines("/usr/include/linux/kernel-page-flags.h")[1]["KPF_ZERO_PAGE"])


def present_pfns(pid):
    """PFN of every present pagemap entry of pid, one per mapped virtual page."""
    chunks = []
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/pagemap", "rb", buffering=0) as pm:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split(None, 1)[0].split("-"))
            data = os.pread(pm.fileno(), (hi - lo) // PAGE * 8, lo // PAGE * 8)
            entries = np.frombuffer(data[: len(data) // 8 * 8], dtype=np.uint64)
            chunks.append(entries[(entries & PM_PRESENT) != 0] & PM_PFN_MASK)
    return np.concatenate(chunks) if chunks else np.zeros(0, np.uint64)


def zero_pfn_mask(pfns):
    """True where /proc/kpageflags says the PFN is the (huge) zero page."""
    if not len(pfns):
        return np.zeros(0, bool)
    lo, hi = int(pfns.min()), int(pfns.max())
    fd = os.open("/proc/kpageflags", os.O_RDONLY)
    try:
        flags = np.frombuffer(os.pread(fd, (hi - lo + 1) * 8, lo * 8), dtype=np.uint64)
    finally:
        os.close(fd)
    return ((flags[(pfns - np.uint64(lo)).astype(np.int64)] >> np.uint64(KPF_ZERO_PAGE)) & np.uint64(1)) != 0


def share_stats(pids):
    """(per-pid {mapped, shared, unique}, set {shared, total}) like the ioctl."""
    mapped, distinct = {}, {}
    for pid in dict.fromkeys(pids):
        pfns = present_pfns(pid)
        pfns = pfns[~zero_pfn_mask(pfns)]
        mapped[pid] = len(pfns)
        distinct[pid] = np.unique(pfns)
    every = np.concatenate(list(distinct.values()))
    pages, members = np.unique(every, return_counts=True)
    shared = pages[members >= 2]
    per_pid = {}
    for pid, own in distinct.items():
        n_shared = int(np.isin(own, shared, assume_unique=True).sum())
        per_pid[pid] = {"mapped": mapped[pid], "shared": n_shared, "unique": len(own) - n_shared}
    return per_pid, {"shared": len(shared), "total": len(pages)}


def group_stats(pids, groups):
    """(per-group {mapped, distinct, shared}, set {shared, total}) like GROUP_STATS:
    a page is shared when two groups map it."""
    mapped, distinct = {}, {}
    for pid, g in dict.fromkeys(zip(pids, groups)):
        pfns = present_pfns(pid)
        pfns = pfns[~zero_pfn_mask(pfns)]
        mapped[g] = mapped.get(g, 0) + len(pfns)
        distinct[g] = np.union1d(distinct.get(g, np.zeros(0, np.uint64)), pfns)
    pages, members = np.unique(np.concatenate(list(distinct.values())), return_counts=True)
    shared = pages[members >= 2]
    per_group = {g: {"mapped": mapped[g], "distinct": len(own),
                     "shared": int(np.isin(own, shared, assume_unique=True).sum())}
                 for g, own in distinct.items()}
    return per_group, {"shared": len(shared), "total": len(pages)}


def zero_entries(pid):
    """How many present pagemap entries of pid map a zero page."""
    return int(zero_pfn_mask(present_pfns(pid)).sum())
