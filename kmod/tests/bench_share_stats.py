"""SHARE_STATS in the kernel against the same count from /proc/PID/pagemap.

Runs a stopped fork family (parent + children, half rewritten) and times both
methods, interleaved, in the same run; under QEMU/TCG only the ratio means
anything.  The last line of output is the JSON result.
"""
import json
import os
import platform
import sys
import time

import pagemap_walk
import uapi
from conftest import Victims

SIZE = 64 << 20
CHILDREN = 3
ROUNDS = 5


def timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def main():
    dev = uapi.Device()
    fam = Victims("family", SIZE, CHILDREN, ready=CHILDREN + 1)
    try:
        fam.rewrite_half([p for p in fam.pids if p != fam.proc.pid])
        fam.stop()
        kernel, user = [], []
        for _ in range(ROUNDS):
            dt, (req, stats) = timed(dev.share_stats, fam.pids)
            kernel.append(dt)
            dt, (_, totals) = timed(pagemap_walk.share_stats, fam.pids)
            user.append(dt)
            if totals != {"shared": req.shared_pages, "total": req.total_pages}:
                sys.exit(f"kernel and pagemap disagree: {req!r} vs {totals!r}")
        # the per-call floor: this small process alone (allocation of the count, walk setup)
        floor = sorted(timed(dev.share_stats, [os.getpid()])[0] for _ in range(ROUNDS))[ROUNDS // 2]
        own = dev.share_stats([os.getpid()])[1][0].mapped_pages
    finally:
        fam.close()
        dev.close()
    k, u = sorted(kernel)[ROUNDS // 2], sorted(user)[ROUNDS // 2]
    print(json.dumps({
        "bench": "share_stats_vs_pagemap",
        "machine": f"qemu-tcg guest {platform.release()}, host {os.environ.get('BUNSHIN_HOST', '?')}",
        "pids": len(fam.pids), "mapped_pages": sum(s.mapped_pages for s in stats),
        "shared_pages": req.shared_pages, "total_pages": req.total_pages, "rounds": ROUNDS,
        "kernel_median_s": round(k, 6), "pagemap_median_s": round(u, 6),
        "pagemap_over_kernel": round(u / k, 2),
        "own_process_pages": own, "own_process_kernel_median_s": round(floor, 6),
    }))


if __name__ == "__main__":
    main()
