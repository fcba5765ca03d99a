"""CRIU persistence and the CRIU baseline (bunshin.criu), measured in one run.

1. Save and load vs workspace size: a workspace (init + a bash session + a Python worker holding
   S MiB of distinct pages, S = 0 means no worker) is snapshotted; `tpl.save(dir)` (a fork of the
   template dumped by CRIU, layers copied) and `Template.load(dir)` (CRIU restore + snapshot) are
   timed, with the image size; `dump_workspace(ws)` / `restore_workspace(dir)` (the baseline's
   per-rollout restore) are timed too.
2. n clones from one image of a workspace whose worker holds 128 MiB (and 256 MiB, full run):
   * restore-n: `restore_workspace(dir)` n times by a stock CRIU (Debian's, the private install:
     n independent workspaces);
   * patched-restore-n: the same by Bunshin's CRIU (its plugin and patch, the default): what the
     patch costs a plain restore (the two alternate, twice; each keeps its faster run);
   * shared-restore-n: `bunshin.criu.restore_many(dir, n)` (restored once into a frozen
     template, forked n times, the template let go: the clones share memory CoW);
   * load-then-fork-n: `Template.load(dir)` once, then `tpl.fork(n)` (the same mechanism as
     shared-restore-n, by hand, with the template kept and counted);
   * restore-n + KSM: `restore_workspace(dir, ksm=True)` n times (PR_SET_MEMORY_MERGE on every
     restored process), then KSM is left to merge (pages_to_scan raised for the run, put back
     after) until pages_sharing stops growing; the merge wall time and ksmd's CPU are reported.
   Memory = distinct physical pages mapped by the family (bunshin.memory.pids_usage: each page
   once; for load-then-fork the frozen template's processes are counted), and Σ cgroup memory;
   "one workspace" is one `restore_workspace(dir)`'s. `shared_restore_over_one_workspace` =
   shared-restore-8's memory / one workspace's; `restore_time_over_stock` = shared-restore-8's
   time per clone / restore-8's (128 MiB); `patched_restore_over_stock` = patched-restore-8's /
   restore-8's time.
   The worker's pages are random (identical across clones of one image, distinct within one),
   so KSM can only merge across clones, as with real heaps.

usage: python bench/criu.py [--quick]   (last stdout line: JSON; PNG in bench/out/)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, memory_facts, png_path
from _workloads import build_workspace

import bunshin
from bunshin import criu
from bunshin.criu import runner
from bunshin.memory import pids_usage

_M = 1 << 20
KSM = Path("/sys/kernel/mm/ksm")


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def cg_bytes(wss) -> int:
    return sum(w.cgroup.stats().memory_current or 0 for w in wss)


def size_sweep(sizes: list[int], tmp: Path, reps: int) -> list[dict]:
    out = []
    for mib in sizes:
        ws = build_workspace(mib, distinct=True).ws
        try:
            d_dump = tmp / f"dump-{mib}"
            t = time.perf_counter()
            criu.dump_workspace(ws, d_dump)
            dump_s = time.perf_counter() - t
            tpl = ws.snapshot()
            saves, loads, restores = [], [], []
            try:
                for i in range(reps):
                    d = tmp / f"tpl-{mib}-{i}"
                    t = time.perf_counter()
                    tpl.save(d)
                    saves.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    t2 = bunshin.Template.load(d)
                    loads.append(time.perf_counter() - t)
                    t2.close()
                    if i:
                        shutil.rmtree(d)
            finally:
                tpl.close()
            for _ in range(reps):
                t = time.perf_counter()
                w = criu.restore_workspace(d_dump)
                restores.append(time.perf_counter() - t)
                w.close()
            img = tmp / f"tpl-{mib}-0"
            pages = sum(p.stat().st_size for p in (img / "criu").glob("pages-*.img"))
            out.append({"worker_mib": mib, "image_bytes": du(img), "pages_bytes": pages,
                        "save_s": statistics.median(saves), "load_s": statistics.median(loads),
                        "dump_workspace_s": dump_s, "restore_workspace_s": statistics.median(restores),
                        "restore_workspace_all_s": restores, "reps": reps})
            print(f"size {mib:5d} MiB: save {out[-1]['save_s']*1e3:.0f} ms, load "
                  f"{out[-1]['load_s']*1e3:.0f} ms, restore {out[-1]['restore_workspace_s']*1e3:.0f} ms, "
                  f"image {out[-1]['image_bytes']/_M:.1f} MiB", file=sys.stderr, flush=True)
        finally:
            ws.close()
    return out


def family_bytes(groups: dict[str, list[int]]) -> dict:
    u = pids_usage(groups)
    return {"distinct_bytes": u.total_bytes, "shared_bytes": u.shared_bytes, "pss_bytes": u.pss_bytes}


def ksmd_cpu_s() -> float:
    import os

    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if (p / "comm").read_text().strip() == "ksmd":
                    f = (p / "stat").read_text().rsplit(")", 1)[1].split()
                    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
            except OSError:
                continue
    return 0.0


def ksm_settle(timeout: float) -> float:
    """Wait until KSM's pages_sharing stops growing (1 s unchanged); seconds waited."""
    t0 = time.monotonic()
    last, since = -1, time.monotonic()
    scans = int((KSM / "full_scans").read_text())  # a count since boot: two more see every page
    while time.monotonic() - t0 < timeout:
        cur = int((KSM / "pages_sharing").read_text())
        if cur != last:
            last, since = cur, time.monotonic()
        elif time.monotonic() - since >= 1.0 and int((KSM / "full_scans").read_text()) >= scans + 2:
            break
        time.sleep(0.1)
    return time.monotonic() - t0


@contextlib.contextmanager
def using_criu(path: str | None):
    """CRIU requests in the block go to the CRIU at ``path`` (None: the default one)."""
    old = os.environ.get("BUNSHIN_CRIU")
    if path is not None:
        os.environ["BUNSHIN_CRIU"] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("BUNSHIN_CRIU", None)
        else:
            os.environ["BUNSHIN_CRIU"] = old


def stock_criu() -> str | None:
    """Debian's CRIU beside Bunshin's patched one (None: the default is the only one)."""
    from bunshin.criu_locate import private_prefix

    path = private_prefix() / "bin" / "criu"
    return str(path) if path.is_file() and str(path) != runner.criu().path else None


def restore_n(img: Path, n: int, criu_path: str | None) -> dict:
    wss = []
    try:
        with using_criu(criu_path):
            t = time.perf_counter()
            for _ in range(n):
                wss.append(criu.restore_workspace(img))
            dt = time.perf_counter() - t
        m = family_bytes({w.id: w.host_pids() for w in wss})
        return {"n": n, "time_s": dt, **m, "cgroup_bytes": cg_bytes(wss)}
    finally:
        for w in wss:
            w.close()


def scaling(img: Path, ns: list[int], ksm_ns: list[int], ksm_timeout: float) -> dict:
    res: dict = {"restore_n": [], "patched_restore_n": [], "shared_restore_n": [], "load_fork_n": [],
                 "restore_n_ksm": []}
    stock = stock_criu()
    one = criu.restore_workspace(img)
    try:
        res["one_workspace"] = {**family_bytes({one.id: one.host_pids()}), "cgroup_bytes": cg_bytes([one])}
    finally:
        one.close()
    for n in ns:
        # stock and patched alternate, twice, each keeping its faster run: the VM's noise (and
        # what the first restores warm up) is not charged to either
        runs: dict[str, list[dict]] = {"restore_n": [], "patched_restore_n": []}
        for _ in range(2):
            runs["restore_n"].append(restore_n(img, n, stock))
            runs["patched_restore_n"].append(restore_n(img, n, None))
        for key, two in runs.items():
            best = min(two, key=lambda r: r["time_s"])
            res[key].append({**best, "times_s": [r["time_s"] for r in two]})
        wss = []
        try:
            t = time.perf_counter()
            wss = criu.restore_many(img, n)
            dt = time.perf_counter() - t
            m = family_bytes({w.id: w.host_pids() for w in wss})
            res["shared_restore_n"].append({"n": n, "time_s": dt, **m, "cgroup_bytes": cg_bytes(wss)})
        finally:
            for w in wss:
                w.close()
        kids = []
        tpl = None
        try:
            t = time.perf_counter()
            tpl = bunshin.Template.load(img)
            kids = tpl.fork(n)
            dt = time.perf_counter() - t
            m = family_bytes({"template": tpl.host_pids(), **{k.id: k.host_pids() for k in kids}})
            res["load_fork_n"].append({"n": n, "time_s": dt, **m, "cgroup_bytes": cg_bytes(kids)})
        finally:
            for k in kids:
                k.close()
            if tpl is not None:
                tpl.close()
        print(f"n={n}: restore-n {res['restore_n'][-1]['time_s']:.2f} s "
              f"{res['restore_n'][-1]['distinct_bytes']/_M:.0f} MiB; patched "
              f"{res['patched_restore_n'][-1]['time_s']:.2f} s; shared-restore-n "
              f"{res['shared_restore_n'][-1]['time_s']:.2f} s "
              f"{res['shared_restore_n'][-1]['distinct_bytes']/_M:.0f} MiB; load+fork-n "
              f"{res['load_fork_n'][-1]['time_s']:.2f} s {res['load_fork_n'][-1]['distinct_bytes']/_M:.0f} MiB",
              file=sys.stderr, flush=True)
    saved = {k: (KSM / k).read_text().strip() for k in ("run", "pages_to_scan", "sleep_millisecs")}
    try:
        (KSM / "pages_to_scan").write_text("4096")  # ~16 MiB per 20 ms pass: KSM at full tilt
        (KSM / "sleep_millisecs").write_text("20")
        for n in ksm_ns:
            wss = []
            try:
                t = time.perf_counter()
                for _ in range(n):
                    wss.append(criu.restore_workspace(img, ksm=True))
                dt = time.perf_counter() - t
                before = family_bytes({w.id: w.host_pids() for w in wss})
                cpu0 = ksmd_cpu_s()
                waited = ksm_settle(ksm_timeout)
                m = family_bytes({w.id: w.host_pids() for w in wss})
                res["restore_n_ksm"].append({
                    "n": n, "time_s": dt, "merge_wait_s": waited, "ksmd_cpu_s": ksmd_cpu_s() - cpu0,
                    "distinct_bytes_before_merge": before["distinct_bytes"], **m,
                    "cgroup_bytes": cg_bytes(wss),
                    "pages_sharing": int((KSM / "pages_sharing").read_text())})
                print(f"n={n}: restore-n+KSM {dt:.2f} s, {m['distinct_bytes']/_M:.0f} MiB after "
                      f"{waited:.1f} s of merging", file=sys.stderr, flush=True)
            finally:
                for w in wss:
                    w.close()
    finally:
        for k in ("pages_to_scan", "sleep_millisecs", "run"):
            (KSM / k).write_text(saved[k])
    res["ksm_settings_restored"] = saved
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sweep (under 2 minutes)")
    args = ap.parse_args()
    info = runner.criu()
    sizes = [0, 128] if args.quick else [0, 64, 256, 1024]
    mibs = [128] if args.quick else [128, 256]
    ns = [1, 8] if args.quick else [1, 2, 4, 8, 16]
    ksm_ns = [8] if args.quick else ns
    tmp = Path(tempfile.mkdtemp(prefix="bunshin-bench-criu-"))
    scaled: dict[int, dict] = {}
    try:
        sweep = size_sweep(sizes, tmp, 2 if args.quick else 3)
        for mib in mibs:
            ws = build_workspace(mib, distinct=True).ws
            try:
                img = tmp / f"scaling-{mib}"
                criu.dump_workspace(ws, img)
            finally:
                ws.close()
            scaled[mib] = scaling(img, ns, ksm_ns if mib == mibs[0] else [], 20 if args.quick else 60)
            shutil.rmtree(img)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    at8 = {mib: _at(sc, 8) for mib, sc in scaled.items()}
    sc = scaled[mibs[0]]
    r, sh, f = at8[mibs[0]]["restore_n"], at8[mibs[0]]["shared_restore_n"], at8[mibs[0]]["load_fork_n"]
    k = sc["restore_n_ksm"][-1]
    big = sweep[-1]
    res = {
        "quick": args.quick, "criu": runner.version_string(info), "memory": memory_facts(),
        "plugin": criu_plugin(), "patches": list(info.patches), "stock_criu": stock_criu(),
        "sizes": sweep, "scaling_worker_mib": mibs[0], "ns": ns,
        "scaling_by_mib": {str(m): v for m, v in scaled.items()},
        "restore_workspace_p50_ms_small": sweep[0]["restore_workspace_s"] * 1e3,
        f"restore_workspace_p50_ms_{big['worker_mib']}mib": big["restore_workspace_s"] * 1e3,
        f"save_ms_{big['worker_mib']}mib": big["save_s"] * 1e3, f"load_ms_{big['worker_mib']}mib": big["load_s"] * 1e3,
        f"image_mib_{big['worker_mib']}mib": big["image_bytes"] / _M,
        "shared_restore_over_one_workspace": sh["distinct_bytes"] / sc["one_workspace"]["distinct_bytes"],
        "restore_time_over_stock": sh["time_s"] / r["time_s"],
        "patched_restore_over_stock": at8[mibs[0]]["patched_restore_n"]["time_s"] / r["time_s"],
        "shared_restore_n8": {str(m): {
            "one_workspace_bytes": scaled[m]["one_workspace"]["distinct_bytes"],
            **{key: {"distinct_bytes": a[key]["distinct_bytes"], "time_per_clone_s": a[key]["time_s"] / 8}
               for key in ("restore_n", "patched_restore_n", "shared_restore_n", "load_fork_n")},
            "shared_restore_over_one_workspace": (a["shared_restore_n"]["distinct_bytes"]
                                                  / scaled[m]["one_workspace"]["distinct_bytes"]),
            "restore_time_over_stock": a["shared_restore_n"]["time_s"] / a["restore_n"]["time_s"]}
            for m, a in at8.items()},
        "restore_n8_time_over_load_fork_n8": r["time_s"] / f["time_s"],
        "restore_n8_memory_over_load_fork_n8": r["distinct_bytes"] / f["distinct_bytes"],
        "restore_ksm_n8_memory_over_load_fork_n8": k["distinct_bytes"] / f["distinct_bytes"],
        "restore_ksm_n8_merge_wait_s": k["merge_wait_s"],
        "counted": ("distinct = physical pages mapped by any process of the family, once (pagemap "
                    "PFNs); load-then-fork counts the frozen template's processes, shared-restore "
                    "lets its template go; times are wall clock on a shared 2-core VM; restore-n is "
                    "sequential"),
    }
    plot(res)
    emit("criu", res)


def _at(sc: dict, n: int) -> dict:
    return {key: next(p for p in sc[key] if p["n"] == n)
            for key in ("restore_n", "patched_restore_n", "shared_restore_n", "load_fork_n")}


def criu_plugin() -> str:
    from bunshin.criu import plugin

    return plugin.plugin_info().describe()


def plot(res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.6))
    s = res["sizes"]
    x = [p["worker_mib"] for p in s]
    a.plot(x, [p["save_s"] * 1e3 for p in s], "o-", label="tpl.save")
    a.plot(x, [p["load_s"] * 1e3 for p in s], "s-", label="Template.load")
    a.plot(x, [p["restore_workspace_s"] * 1e3 for p in s], "^-", label="restore_workspace")
    a.set_xlabel("worker MiB")
    a.set_ylabel("ms")
    a2 = a.twinx()
    a2.bar(x, [p["image_bytes"] / _M for p in s], width=12, alpha=0.25, color="gray", label="image MiB")
    a2.set_ylabel("image MiB")
    a.set_title(f"CRIU {res['criu']}: save / load vs workspace size")
    a.legend(fontsize=8, loc="upper left")
    ns = res["ns"]
    sc = res["scaling_by_mib"][str(res["scaling_worker_mib"])]
    for key, lab, st in (("restore_n", "restore-n (stock CRIU)", "o-"),
                         ("patched_restore_n", "restore-n (Bunshin's CRIU)", "x--"),
                         ("shared_restore_n", "restore_many(n) (shared)", "d-"),
                         ("load_fork_n", "load once + fork n (Bunshin)", "s-"),
                         ("restore_n_ksm", "restore-n + KSM", "^-")):
        pts = sc[key]
        b.plot([p["n"] for p in pts], [p["time_s"] for p in pts], st, label=lab)
        c.plot([p["n"] for p in pts], [p["distinct_bytes"] / _M for p in pts], st, label=lab)
    b.set_xlabel("n")
    b.set_ylabel("s")
    b.set_title("time to n running clones")
    c.set_xlabel("n")
    c.set_ylabel("MiB (distinct pages)")
    c.set_title(f"memory of n clones ({res['scaling_worker_mib']} MiB worker)")
    for ax in (b, c):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path("criu"), dpi=110)


if __name__ == "__main__":
    main()
