"""End-to-end group rollouts: memory over time, peak, GB·s and latency of each engine mode.

One workload (bench/workloads/, default: the real-repository task), one group of ``--group``
rollouts replayed from its traces by a ReplayPolicy (``--think`` seconds of generation per step,
±``--jitter``, seeded), run in every mode one after the other in this process:

* ``podman``  — a real container per rollout (podman + runc), the setup replayed in each, one
  ``podman exec`` per tool call (bench/_podman.py): what users run today;
* ``podman-checkpoint`` — setup once in a container, podman's CRIU checkpoint of it, one
  ``podman container restore`` per rollout;
* ``fresh``   — a new workspace per rollout, the task's setup replayed each time;
* ``criu``    — setup once, CRIU dump, one CRIU restore per rollout (when a CRIU ≥ 4 is found);
* ``fork``    — setup once, snapshot, one live fork per rollout;
* ``bunshin`` — fork + prefix cache + speculation.

Every mode runs on the same root filesystem: for ``repo``, a Debian bookworm root with the
workload's packages (mmdebstrap, built once into the cache), imported as the podman image
(``--rootfs host``: the host view, and no podman modes). Memory is sampled every 100 ms over
everything Bunshin holds, or over the containers' cgroups and their conmons (shared pages counted
once). The ratios to ``podman``, ``podman-checkpoint``, ``fresh`` and ``criu`` are the result;
the aims are bunshin's latency ≤ 0.5×, peak ≤ 0.3× and GB·s ≤ 0.2× of podman's and below
podman-checkpoint on all three; peak ≤ 0.4×, GB·s ≤ 0.35× and latency ≤ 0.6× of fresh, and below
criu on all three.

usage: python bench/e2e.py [--quick] [--workload NAME] [--group N] [--think S] [--modes a,b]
                           [--rootfs image|host]
(last stdout line: JSON; PNG in bench/out/e2e.png)
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _podman
from _common import emit, memory_facts, png_path

from bunshin.criu_locate import find_criu
from bunshin.rl.engine import MODES, RolloutEngine
from bunshin.rl.policies import ReplayPolicy

AIMS = {"peak_bytes": 0.4, "gb_s": 0.35, "latency_s": 0.6}
AIMS_VS_PODMAN = {"peak_bytes": 0.3, "gb_s": 0.2, "latency_s": 0.5}
METRICS = tuple(AIMS)
ALL_MODES = (*_podman.MODES, *MODES)
# the Debian packages each workload's image needs beyond minbase (the same root for every mode)
IMAGE_PACKAGES = {"repo": ("curl", "git", "python3", "python3-pip")}


def run_mode(mode: str, wl, args, progress) -> dict:
    policy = ReplayPolicy(wl.traces, think_s=args.think, jitter=args.jitter, seed=args.seed)
    steps = sum(len(t) for t in wl.traces)
    bar = progress.add_task(f"{mode:8s}", total=steps)
    if mode in _podman.MODES:
        g = _podman.run_group(mode, args.image.tag, wl.task, policy, args.group, args.criu_path,
                              on_turn=lambda i, t: progress.advance(bar))
    else:
        with RolloutEngine(policy, wl.task, args.group, mode=mode, ksm=args.ksm,
                           on_turn=lambda i, t: progress.advance(bar)) as eng:
            g = eng.run()
    progress.update(bar, completed=steps)
    d = g.as_dict()
    d["timeline"] = {"t": [round(x, 3) for x in g.memory.times], "bytes": g.memory.bytes}
    failed = sum(1 for t in g.trajectories for turn in t.turns if turn.exit_code != 0)
    d["calls_failed"] = failed
    d["calls_unexpected"] = sum(1 for t in g.trajectories for k, turn in enumerate(t.turns)
                                if k < len(wl.expect[t.index]) and wl.expect[t.index][k] is not None
                                and turn.exit_code != wl.expect[t.index][k])
    return d


def ratios(modes: dict, base: str) -> dict:
    if base not in modes or "peak_bytes" not in modes[base]:
        return {}
    b = modes[base]
    return {m: {k: r[k] / b[k] if b[k] else None for k in METRICS}
            for m, r in modes.items() if m != base and "peak_bytes" in r}


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from workloads import DEFAULT, WORKLOADS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="group of 2, short traces and think time (< 2 min)")
    p.add_argument("--workload", default=DEFAULT, choices=sorted(WORKLOADS))
    p.add_argument("--group", type=int, default=None, help="rollouts per group (default 8; quick 2)")
    p.add_argument("--think", type=float, default=None,
                   help="seconds of generation per step (default: the workload's params['think_s'])")
    p.add_argument("--jitter", type=float, default=None, help="think time varies by ± this fraction "
                   "(default: the workload's params['think_jitter'])")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default=",".join(ALL_MODES), help=f"comma-separated subset of {ALL_MODES}")
    p.add_argument("--ksm", action="store_true", help="criu mode: restore with KSM merging on")
    p.add_argument("--rootfs", choices=("image", "host"), default=None,
                   help="image: the workload's Debian root for every mode, podman's image made of it "
                   "(default where the workload names its packages); host: the host view")
    args = p.parse_args()
    # the sampler counts every workspace under the cgroup prefix: this run's alone, not those of
    # other programs using Bunshin on the machine
    os.environ.setdefault("BUNSHIN_CGROUP_PREFIX", f"bunshin-e2e-{os.getpid()}")
    args.group = args.group or (2 if args.quick else 8)
    args.rootfs = args.rootfs or ("image" if args.workload in IMAGE_PACKAGES else "host")
    logging.basicConfig(level=logging.WARNING)
    from rich.console import Console

    wl = WORKLOADS[args.workload](args.group, seed=args.seed, quick=args.quick)
    if args.rootfs == "image":
        from bunshin.runtime.rootfs import build_debian

        root = build_debian("bookworm", include=IMAGE_PACKAGES.get(args.workload, ()))
        wl = dataclasses.replace(wl, task=dataclasses.replace(wl.task, rootfs=str(root)))
        wl.params = {**wl.params, "rootfs": {"debian": "bookworm", "variant": "minbase",
                                             "packages": list(IMAGE_PACKAGES.get(args.workload, ()))}}
    args.think = args.think if args.think is not None else wl.params.get("think_s", 0.5)
    args.jitter = args.jitter if args.jitter is not None else wl.params.get("think_jitter", 0.3)
    modes: dict[str, dict] = {}
    criu = find_criu()
    args.criu_path = str(criu.path) if criu is not None and criu.usable else None
    console = Console(stderr=True, width=None if Console(stderr=True).is_terminal else 140)
    t0 = time.monotonic()
    args.image = None
    try:
        _run_modes(args, wl, criu, console, modes)
    finally:
        if args.image is not None:
            args.image.close()
    vs_fresh, vs_criu = ratios(modes, "fresh"), ratios(modes, "criu")
    vs_podman, vs_podman_ck = ratios(modes, "podman"), ratios(modes, "podman-checkpoint")
    aims = {}
    if "bunshin" in vs_podman:
        aims.update({f"{k}_vs_podman<={v}": vs_podman["bunshin"][k] is not None and vs_podman["bunshin"][k] <= v
                     for k, v in AIMS_VS_PODMAN.items()})
    if "bunshin" in vs_podman_ck:
        aims.update({f"{k}_below_podman_checkpoint": vs_podman_ck["bunshin"][k] < 1 for k in METRICS})
    if "bunshin" in vs_fresh:
        aims |= {f"{k}_vs_fresh<={v}": vs_fresh["bunshin"][k] is not None and vs_fresh["bunshin"][k] <= v
                for k, v in AIMS.items()}
        if "bunshin" in vs_criu:
            aims.update({f"{k}_below_criu": vs_criu["bunshin"][k] < 1 for k in METRICS})
    res = {"quick": args.quick, "workload": args.workload, "params": wl.params,
           "group": args.group, "think_s": args.think, "jitter": args.jitter, "seed": args.seed,
           "rootfs": args.rootfs, "modes": modes, "ratios_vs_podman": vs_podman,
           "ratios_vs_podman_checkpoint": vs_podman_ck, "ratios_vs_fresh": vs_fresh,
           "ratios_vs_criu": vs_criu, "aims": aims,
           "wall_s": time.monotonic() - t0, "memory_facts": memory_facts(),
           **({"podman_image_import_s": args.image_import_s} if args.image is not None else {})}
    _drop_prefix()
    plot(res)
    _table(console, res)
    emit("e2e", res)
    return 0


def _run_modes(args, wl, criu, console, modes: dict) -> None:
    from rich.progress import Progress

    with Progress(console=console) as progress:
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            if mode == "criu" and (criu is None or not criu.usable):
                modes[mode] = {"available": False,
                               "reason": "no CRIU found" if criu is None else criu.reason}
                continue
            if mode in _podman.MODES:
                why = _podman_image(args, wl, mode)
                if why is not None:
                    modes[mode] = {"available": False, "reason": why}
                    console.print(f"[red]{mode}: {why}")
                    continue
            try:
                modes[mode] = run_mode(mode, wl, args, progress)
            except Exception as e:  # noqa: BLE001 - a mode that cannot run is a finding, not a crash
                modes[mode] = {"available": False, "reason": f"{type(e).__name__}: {e}"}
                console.print(f"[red]{mode}: {e}")


def _podman_image(args, wl, mode: str) -> str | None:
    """Why podman ``mode`` cannot run, or None with ``args.image`` made (once for both modes, as
    the Bunshin modes' root is resolved once)."""
    if args.rootfs != "image":
        return "podman runs an image: this run is on the host view (--rootfs host)"
    why = _podman.why_not(args.criu_path, mode)
    if why is None and args.image is None:
        t = time.monotonic()
        try:
            args.image = _podman.Image(_podman.Podman(), Path(wl.task.rootfs), _podman.image_tag())
        except _podman.PodmanError as e:
            return f"podman import failed: {e}"
        args.image_import_s = time.monotonic() - t
    return why


def _drop_prefix() -> None:
    """Remove this run's (empty) cgroup prefix directories."""
    from bunshin import config

    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[fields.index("-") + 1] in ("cgroup", "cgroup2"):
            top = Path(fields[4]) / config.cgroup_prefix()
            if not top.is_dir():
                continue
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [top]:
                try:
                    d.rmdir()  # a cgroup directory goes with its control files
                except OSError:
                    pass  # still in use: left for `bunshin gc`


def _table(console, res: dict) -> None:
    from rich.table import Table

    t = Table(title=f"e2e: {res['workload']}, group of {res['group']}, think {res['think_s']} s")
    for c in ("mode", "latency s", "peak MiB", "GB·s", "× podman: peak / GB·s / lat", "× podman-ckpt",
              "× fresh", "× criu", "cache hits", "spec hits"):
        t.add_column(c, justify="right")

    def rel(m: str, base: str) -> str:
        r = res[f"ratios_vs_{base.replace('-', '_')}"].get(m)
        return "/".join(f"{r[k]:.2f}" for k in METRICS) if r else ("1" if m == base else "—")

    for m, r in res["modes"].items():
        if "peak_bytes" not in r:
            t.add_row(m, "—", "—", "—", r.get("reason", "")[:40], "", "", "", "", "")
            continue
        t.add_row(m, f"{r['latency_s']:.2f}", f"{r['peak_bytes'] / 2**20:.0f}", f"{r['gb_s']:.2f}",
                  rel(m, "podman"), rel(m, "podman-checkpoint"), rel(m, "fresh"), rel(m, "criu"),
                  str(r.get("cache", {}).get("hits", "")), str(r.get("speculation", {}).get("hits", "")))
    console.print(t)


def plot(res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = {m: r for m, r in res["modes"].items() if "peak_bytes" in r}
    colors = {"podman": "#8c564b", "podman-checkpoint": "#e377c2", "fresh": "#7f7f7f", "criu": "#d62728",
              "fork": "#1f77b4", "bunshin": "#2ca02c"}
    fig = plt.figure(figsize=(12, 7))
    ax = fig.add_subplot(2, 1, 1)
    for m, r in ran.items():
        ax.plot(r["timeline"]["t"], [b / 2**20 for b in r["timeline"]["bytes"]], label=m, color=colors.get(m))
    ax.set_xlabel("seconds since the group started")
    ax.set_ylabel("MiB held (pages counted once)")
    ax.set_title(f"Memory over time: {res['workload']}, group of {res['group']}, think {res['think_s']} s"
                 f"{' (--quick)' if res['quick'] else ''}")
    ax.legend()
    names = list(ran)
    cols = [colors.get(m) for m in names]
    for k, (key, label, scale) in enumerate((("latency_s", "group latency (s)", 1),
                                             ("peak_bytes", "peak memory (MiB)", 2**20),
                                             ("gb_s", "memory × time (GB·s)", 1))):
        a = fig.add_subplot(2, 3, 4 + k)
        vals = [ran[m][key] / scale for m in names]
        a.bar(names, vals, color=cols)
        base = "ratios_vs_podman" if res["ratios_vs_podman"] else "ratios_vs_fresh"
        for i, m in enumerate(names):
            rf = res[base].get(m, {}).get(key)
            if rf is not None:
                a.text(i, vals[i], f"{rf:.2f}×", ha="center", va="bottom", fontsize=8)
        a.set_title(label)
    fig.tight_layout()
    fig.savefig(png_path("e2e"), dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
