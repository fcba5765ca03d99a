"""Fork latency of live workspaces next to native fork() of the same processes and CRIU.

Three workspaces: small (init + a bash session), medium (+ a Python holding 256 MiB of touched
memory), large (+ 2 GiB; 1 GiB with --quick). For each, interleaved in one loop:
  * native: the workload processes time their own fork() — the Python worker on SIGUSR2 times
    os.fork() (child _exits at once); bash times a `( : )` subshell with $EPOCHREALTIME (fork +
    child exit + wait: an upper bound). Σ native = bash + Python per iteration: the physical
    floor of copying these processes (bunshin-init, a small static C program, is not counted).
  * bunshin `tpl.fork(1)` from a snapshot taken once (the child is closed outside the timing);
    its child's init was cloned ahead while the loop did the rest; then, after the loop, the same
    forks back to back with BUNSHIN_EARLY_INIT=0 (each clones its child's init itself);
  * bunshin `ws.fork(1)` = snapshot + fork, what users call;
  * bunshin `tpl.fork(8)`, a group (after the loop; 50 ms of idle time between two groups).
CRIU (when find_criu() gives a usable one): the medium worker as a plain host process (setsid),
`criu dump --leave-running` then, the original killed (a restore needs its pid free), `criu
restore --restore-detached`, images on tmpfs; the restored copy is dumped next time.

Two application workspaces ("apps" in the JSON), measured the same way:
  * server: init + bash + Redis (100k keys, DEBUG POPULATE) + `python3 -m http.server`. Native:
    Redis's own fork() time (BGSAVE, then INFO stats latest_fork_usec) + bash's `( : )`;
    http.server and bunshin-init are not counted. Child check: dbsize == 100000, HTTP 200.
  * gui: init + bash + Xvfb :9 1280x800x24 (-shmem) + xeyes + xclock. Native: not measurable
    (Xvfb and the X clients have no way to time their own fork()): Bunshin times only.
    Child check: `xwd -root` succeeds in the child.
  CRIU: not measured for either (the CRIU baseline covers the medium worker only).

Isolation: everything runs in the default isolation (sandbox: each workspace in a user
namespace of its own) or the one --isolation names (the JSON's name then ends in _trusted);
the small and medium workspaces are measured once more under the other isolation, side by
side ("other_isolation" in the JSON), with the ratios sandbox / trusted of their fork times.

usage: python bench/fork_latency.py [--quick] [--sizes small,medium] [--isolation trusted]
(last stdout line: JSON; PNG in bench/out/, with all sizes)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, memory_facts, png_path, summary  # noqa: E402
from _workloads import (GUI_DISPLAY, REDIS_KEYS, Loaded, build_gui_workspace,  # noqa: E402
                        build_server_workspace, build_workspace, http_ok, native_bash_forks,
                        native_python_forks, native_redis_forks, redis_cli, start_host_worker,
                        wait_lines)

from bunshin import config  # noqa: E402
from bunshin.criu_locate import find_criu  # noqa: E402

MEDIUM_MIB = 256
# ws.fork() and ws.snapshot() are sampled at most this many times per workspace (the JSON says
# so); the source keeps its pid namespace level (pid_ns_depth_of_source_after).
WS_FORK_MAX = 24
GROUP = 8  # children of one tpl.fork() call in the group figure
_PR_SET_CHILD_SUBREAPER = 36


def timed_fork(fork) -> float:
    t = time.perf_counter()
    kids = fork()
    dt = time.perf_counter() - t
    for k in kids:
        k.close()
    return dt


def check_child(ld, kid) -> bool:
    """The child runs the same programs, takes tool calls, and its worker still forks."""
    want = sorted(p.cmdline[:1] for p in ld.ws.processes())
    if sorted(p.cmdline[:1] for p in kid.processes()) != want or kid.run("true").exit_code != 0:
        return False
    return ld.pid is None or len(native_python_forks(Loaded(kid, None, ld.pid, ld.mib), 1)) == 1


def measure_size(name: str, mib: int, n: int) -> dict:
    ld = build_workspace(mib)
    try:
        tpl = ld.ws.snapshot()
        try:
            kid = tpl.fork(1)[0]
            try:
                child_ok = check_child(ld, kid)
            finally:
                kid.close()
            for _ in range(2):  # warm-up
                timed_fork(lambda: tpl.fork(1))
            py, bash, tplf, wsf, snap = [], [], [], [], []
            for _ in range(n):
                if mib:
                    py += native_python_forks(ld, 1)
                bash += native_bash_forks(ld.sh, 1)
                tplf.append(timed_fork(lambda: tpl.fork(1)))
                if len(wsf) < WS_FORK_MAX:
                    wsf.append(timed_fork(lambda: ld.ws.fork(1)))
                    snap.append(timed_fork(lambda: [ld.ws.snapshot()]))
            # the same forks with each child's init cloned by the fork itself, as back-to-back
            # forks with no idle time between them get (bunshin/fork/earlyinit.py)
            cold = []
            os.environ["BUNSHIN_EARLY_INIT"] = "0"
            try:
                timed_fork(lambda: tpl.fork(1))  # takes the slot whose init was made ahead
                for _ in range(n):
                    cold.append(timed_fork(lambda: tpl.fork(1)))
            finally:
                del os.environ["BUNSHIN_EARLY_INIT"]
            # a group: tpl.fork(GROUP), what a GRPO step asks for
            group = []
            timed_fork(lambda: tpl.fork(GROUP))  # its slots and inits, made ahead for the next
            for _ in range(max(3, n // 4)):
                time.sleep(0.05)  # the trainer's own work between two groups
                group.append(timed_fork(lambda: tpl.fork(GROUP)))
            # after its ws.fork() calls: copies of the worker alive (the source's, the template's,
            # the intermediate made ahead for the template's next child)
            chain = _count_worker_copies(ld) if mib else None
            pid_ns_depth = _pid_ns_depth(ld.ws.init_pid)
        finally:
            tpl.close()
    finally:
        ld.close()
    native = [b + (py[i] if py else 0.0) for i, b in enumerate(bash)]
    res = {"mib": mib, "processes": ["bunshin-init", "bash"] + (["python3 worker"] if mib else []),
           "native_bash_subshell": summary(bash), "native_sum": summary(native),
           "bunshin_tpl_fork": summary(tplf), "bunshin_ws_fork": summary(wsf),
           "bunshin_ws_snapshot": summary(snap), "child_ok": child_ok,
           "bunshin_tpl_fork_init_not_ahead": summary(cold),
           f"bunshin_tpl_fork_{GROUP}": summary(group),
           f"bunshin_tpl_fork_{GROUP}_per_child_p50_ms": statistics.median(group) * 1e3 / GROUP}
    if py:
        res["native_python_fork"] = summary(py)
    res["ws_fork_samples"] = len(wsf)
    res["pid_ns_depth_of_source_after"] = pid_ns_depth
    third = max(1, len(wsf) // 3)
    res["ws_fork_first_third_p50_ms"] = statistics.median(wsf[:third]) * 1e3
    res["ws_fork_last_third_p50_ms"] = statistics.median(wsf[-third:]) * 1e3
    if chain is not None:
        res["worker_copies_alive_after_ws_forks"] = chain
    nat = res["native_sum"]["p50_ms"]
    for k in ("bunshin_tpl_fork", "bunshin_ws_fork", "bunshin_ws_snapshot", "bunshin_tpl_fork_init_not_ahead"):
        res[f"{k}_over_native"] = res[k]["p50_ms"] / nat
        res[f"{k}_minus_native_ms"] = res[k]["p50_ms"] - nat
    return res


APPS = {
    "server": {"build": build_server_workspace,
               "processes": ["bunshin-init", "bash", "redis-server", "python3 -m http.server"],
               "child_check": f"processes and tool calls as in the source; redis-cli dbsize == {REDIS_KEYS}; "
                              "http.server answers 200"},
    "gui": {"build": build_gui_workspace,
            "processes": ["bunshin-init", "bash", "Xvfb :9 1280x800x24 -shmem", "xeyes", "xclock"],
            "child_check": "processes and tool calls as in the source; xwd -root succeeds"},
}


def _app_child_ok(kind: str, ld, kid) -> bool:
    if not check_child(ld, kid):
        return False
    if kind == "server":
        return redis_cli(kid, "dbsize") == str(REDIS_KEYS).encode() and http_ok(kid)
    r = kid.run("xwd -root -silent | wc -c", env=GUI_DISPLAY)
    return r.ok and int(r.stdout.strip() or 0) > 1280 * 800 * 3


def measure_app(kind: str, n: int) -> dict:
    """Like measure_size, for the server (Redis + http.server) and gui (Xvfb + 2 clients) kinds."""
    spec = APPS[kind]
    ld = spec["build"]()
    extra: dict = {}
    try:
        if kind == "server":
            info = redis_cli(ld.ws, "info", "memory").decode()
            extra["redis_keys"] = int(redis_cli(ld.ws, "dbsize"))
            extra["redis_used_memory_bytes"] = int(info.split("used_memory:")[1].split()[0])
        tpl = ld.ws.snapshot()
        try:
            kid = tpl.fork(1)[0]
            try:
                child_ok = _app_child_ok(kind, ld, kid)
            finally:
                kid.close()
            for _ in range(2):  # warm-up
                timed_fork(lambda: tpl.fork(1))
            red, bash, tplf, wsf = [], [], [], []
            for _ in range(n):
                if kind == "server":
                    red += native_redis_forks(ld.sh, 1)
                    bash += native_bash_forks(ld.sh, 1)
                tplf.append(timed_fork(lambda: tpl.fork(1)))
                if len(wsf) < WS_FORK_MAX:
                    wsf.append(timed_fork(lambda: ld.ws.fork(1)))
            pid_ns_depth = _pid_ns_depth(ld.ws.init_pid)
        finally:
            tpl.close()
    finally:
        ld.close()
    res = {"processes": spec["processes"], **extra,
           "bunshin_tpl_fork": summary(tplf), "bunshin_ws_fork": summary(wsf),
           "child_ok": child_ok, "child_check": spec["child_check"],
           "ws_fork_samples": len(wsf), "pid_ns_depth_of_source_after": pid_ns_depth,
           "criu": "not measured (the CRIU baseline covers the medium Python worker only)"}
    if kind == "server":
        native = [b + r for b, r in zip(bash, red)]
        res["native_redis_fork"] = summary(red)
        res["native_redis_fork_source"] = "redis INFO stats latest_fork_usec after BGSAVE"
        res["native_bash_subshell"] = summary(bash)
        res["native_sum"] = summary(native)
        res["native_not_counted"] = ["bunshin-init", "python3 -m http.server"]
        nat = res["native_sum"]["p50_ms"]
        for k in ("bunshin_tpl_fork", "bunshin_ws_fork"):
            res[f"{k}_over_native"] = res[k]["p50_ms"] / nat
            res[f"{k}_minus_native_ms"] = res[k]["p50_ms"] - nat
    else:
        res["native"] = None
        res["native_reason"] = ("not measurable: Xvfb and the X clients cannot time their own "
                                "fork(); Bunshin times only")
    return res


def _pid_ns_depth(hostpid: int) -> int:
    """How many pid namespaces below the host's the process is (NSpid entries - 1)."""
    with open(f"/proc/{hostpid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return len(line.split()) - 2
    return -1


def _count_worker_copies(ld) -> int:
    """Host processes whose command line is this run's worker (source, templates, leftovers)."""
    n = 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
            except OSError:
                continue
            if len(cmd) > 3 and cmd[1] == b"-c" and b"on_usr2" in cmd[2] and cmd[3] == str(ld.mib).encode():
                n += 1
    return n


def measure_criu(mib: int, n: int) -> dict:
    info = find_criu()
    if info is None or not info.usable:
        return {"available": False, "reason": "no CRIU found" if info is None else info.reason}
    res: dict = {"available": True, "criu": info.path, "version": ".".join(map(str, info.version)),
                 "mib": mib, "images_on": "/dev/shm (tmpfs)"}
    # restored copies are re-parented to us (not to init), so we can reap them
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    work = tempfile.mkdtemp(prefix="bunshin-bench-criu-", dir="/dev/shm")
    log = os.path.join(work, "forks.log")
    img = os.path.join(work, "img")
    pid = None
    dumps, restores, host_py = [], [], []
    try:
        p = start_host_worker(mib, log)
        pid = p.pid
        for i in range(10):  # the same worker's native fork, on the host
            os.kill(pid, signal.SIGUSR2)
            wait_lines(lambda: _read_lines(log), i + 1)
        host_py = [float(x) for x in _read_lines(log)]
        for i in range(n):
            shutil.rmtree(img, ignore_errors=True)
            os.mkdir(img)
            t = time.perf_counter()
            r = subprocess.run([info.path, "dump", "-t", str(pid), "-D", img, "--shell-job",
                                "--leave-running", "-o", "dump.log"], capture_output=True, text=True, check=False)
            dt = time.perf_counter() - t
            if r.returncode != 0:
                raise RuntimeError(f"criu dump exit {r.returncode}: {_tail(img, 'dump.log', r)}")
            dumps.append(dt)
            res["image_bytes"] = sum(f.stat().st_size for f in Path(img).iterdir())
            _kill_reap(pid)
            pid = None
            t = time.perf_counter()
            r = subprocess.run([info.path, "restore", "-D", img, "--shell-job", "--restore-detached",
                                "-o", "restore.log"], capture_output=True, text=True, check=False)
            dt = time.perf_counter() - t
            if r.returncode != 0:
                raise RuntimeError(f"criu restore exit {r.returncode}: {_tail(img, 'restore.log', r)}")
            restores.append(dt)
            pid = p.pid  # CRIU restores the same pid
            if not os.path.exists(f"/proc/{pid}"):
                raise RuntimeError("criu restore succeeded but the process is not running")
    except Exception as e:  # noqa: BLE001 - CRIU's failure is a figure, not a crash
        res["error"] = str(e)[-600:]
    finally:
        if pid is not None:
            _kill_reap(pid)
        shutil.rmtree(work, ignore_errors=True)
    if dumps:
        res["dump"] = summary(dumps)
    if restores:
        res["restore"] = summary(restores)
        res["dump_plus_restore"] = summary([d + r for d, r in zip(dumps, restores)])
    if host_py:
        res["host_native_python_fork"] = summary(host_py)
    return res


def _read_lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().split()
    except FileNotFoundError:
        return []


def _tail(img: str, logname: str, r: subprocess.CompletedProcess) -> str:
    try:
        with open(os.path.join(img, logname)) as f:
            lines = [ln for ln in f.read().splitlines() if "Error" in ln]
        if lines:
            return " | ".join(lines[-3:])
    except OSError:
        pass
    return (r.stderr or r.stdout).strip()[-300:]


def _kill_reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:  # not ours: wait until it is gone
        end = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < end:
            time.sleep(0.005)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, 1 GiB large (under 2 minutes)")
    ap.add_argument("--sizes", default="small,medium,large",
                    help="the workspace sizes to measure (comma-separated); the apps and CRIU only "
                         "with all three: `--quick --sizes small,medium` gives the aims' figures alone")
    ap.add_argument("--isolation", choices=("trusted", "sandbox"), default=config.isolation(),
                    help="the workspaces' isolation (Workspace.create(isolation=...)); small and "
                         "medium are measured under the other one too")
    args = ap.parse_args()
    os.environ["BUNSHIN_ISOLATION"] = args.isolation  # what Workspace.create uses unless told
    suffix = "" if args.isolation == "sandbox" else "_" + args.isolation
    n, n_criu = (20, 5) if args.quick else (40, 15)
    large = 1024 if args.quick else 2048
    sizes = {"small": 0, "medium": MEDIUM_MIB, "large": large}
    chosen = args.sizes.split(",")
    if unknown := set(chosen) - set(sizes):
        ap.error(f"unknown sizes {sorted(unknown)}: choose among {list(sizes)}")
    res: dict = {"quick": args.quick, "isolation": args.isolation, "iterations": n, "large_mib": large, "memory": memory_facts(),
                 "ws_fork_max_per_workspace": WS_FORK_MAX,
                 "sizes": {name: measure_size(name, mib, n) for name, mib in sizes.items() if name in chosen}}
    res["other_isolation"] = _other_isolation(args.isolation, res["sizes"], n)
    if set(chosen) != set(sizes):  # a partial run: beside the full run's figures, not over them
        res["aims"] = _ws_aims(res["sizes"])
        emit("fork_latency_" + "_".join(name for name in sizes if name in chosen) + suffix, res)
        return
    res["apps"] = {kind: measure_app(kind, n) for kind in APPS}
    res["criu"] = measure_criu(MEDIUM_MIB, n_criu)
    med, small = res["sizes"]["medium"], res["sizes"]["small"]
    nat = med["native_sum"]["p50_ms"]

    res["aims"] = {
        **_ws_aims(res["sizes"]),
        "medium_tpl_fork_le_1.25x_native_plus_0.5ms": med["bunshin_tpl_fork"]["p50_ms"] <= 1.25 * nat + 0.5,
        "medium_ws_fork_le_1.25x_native_plus_0.5ms": med["bunshin_ws_fork"]["p50_ms"] <= 1.25 * nat + 0.5,
        "small_tpl_fork_lt_1ms": small["bunshin_tpl_fork"]["p50_ms"] < 1.0,
        "small_ws_fork_lt_1ms": small["bunshin_ws_fork"]["p50_ms"] < 1.0,
    }
    c = res["criu"]
    if "dump_plus_restore" in c:
        res["criu_dump_restore_over_bunshin_tpl_fork_medium"] = (
            c["dump_plus_restore"]["p50_ms"] / med["bunshin_tpl_fork"]["p50_ms"])
    plot(res)
    emit("fork_latency" + suffix, res)


def _other_isolation(isolation: str, sizes: dict, n: int) -> dict:
    """Small and medium (those of ``sizes``) measured again under the isolation that is not
    ``isolation``, and sandbox / trusted of the p50 of each fork."""
    other = "trusted" if isolation == "sandbox" else "sandbox"
    os.environ["BUNSHIN_ISOLATION"] = other
    try:
        again = {name: measure_size(name, MEDIUM_MIB if name == "medium" else 0, n)
                 for name in ("small", "medium") if name in sizes}
    finally:
        os.environ["BUNSHIN_ISOLATION"] = isolation
    by = {isolation: sizes, other: again}
    return {"isolation": other, "sizes": again, "sandbox_over_trusted": {
        name: {k: by["sandbox"][name][k]["p50_ms"] / by["trusted"][name][k]["p50_ms"]
               for k in ("bunshin_tpl_fork", "bunshin_ws_fork", f"bunshin_tpl_fork_{GROUP}")}
        for name in again}}


def _ws_aims(sizes: dict) -> dict:
    """Issue 21's aim for the path users call, for the small and medium sizes measured."""

    def within(size: dict, key: str) -> bool:
        return size[key]["p50_ms"] <= 1.25 * size["native_sum"]["p50_ms"] + 1.0

    return {f"{name}_{what}_le_1.25x_native_plus_1ms": within(sizes[name], f"bunshin_{what}")
            for name in ("small", "medium") if name in sizes for what in ("ws_fork", "ws_snapshot")}


def _per_child(s: dict, name: str) -> dict | None:
    g = s.get(f"bunshin_tpl_fork_{GROUP}")
    return {"p50_ms": g["p50_ms"] / GROUP, "p95_ms": g["p95_ms"] / GROUP} if g else None


def plot(res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 5.2))
    series = [("native Σ fork()", "#999", lambda s, name: s.get("native_sum")),
              ("bunshin tpl.fork(1)", "#1f77b4", lambda s, name: s.get("bunshin_tpl_fork")),
              ("tpl.fork(1), init not made ahead", "#9ecae1",
               lambda s, name: s.get("bunshin_tpl_fork_init_not_ahead")),
              (f"tpl.fork({GROUP}) per child", "#08519c", _per_child),
              ("bunshin ws.fork(1)", "#6baed6", lambda s, name: s.get("bunshin_ws_fork")),
              ("CRIU dump+restore", "#d62728",
               lambda s, name: res["criu"].get("dump_plus_restore") if name == "medium" else None)]
    groups = {**res["sizes"], **res.get("apps", {})}
    names = list(groups)
    w = 0.14
    for j, (label, color, get) in enumerate(series):
        xs, p50, p95 = [], [], []
        for i, name in enumerate(names):
            s = get(groups[name], name)
            if s:
                xs.append(i + (j - 2.5) * w)
                p50.append(s["p50_ms"])
                p95.append(s["p95_ms"])
        if not xs:
            continue
        ax.bar(xs, p50, w, color=color, label=f"{label} p50")
        ax.scatter(xs, p95, color="k", marker="_", s=200, zorder=3)
        for x, v in zip(xs, p50):
            ax.text(x, v, f"{v:.3g}", ha="center", va="bottom", fontsize=7)
    ax.scatter([], [], color="k", marker="_", s=200, label="p95")
    ax.set_yscale("log")
    app_label = {"server": "server\n(redis 100k keys\n+ http.server)",
                 "gui": "gui\n(Xvfb + xeyes + xclock;\nno native)"}
    ax.set_xticks(range(len(names)), [app_label[nm] if nm in app_label
                                      else f"{nm}\n({groups[nm]['mib']} MiB worker)" if groups[nm]['mib']
                                      else f"{nm}\n(init + bash)" for nm in names])
    ax.set_ylabel("ms (log)")
    ax.set_title(f"Workspace fork latency vs native fork() and CRIU{' (--quick)' if res['quick'] else ''}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path("fork_latency"), dpi=110)


if __name__ == "__main__":
    main()
