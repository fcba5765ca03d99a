"""The library with the module against the library without it, in one guest run.

- accounting: bunshin.memory.pids_usage over a stopped fork family, GROUP_STATS in the kernel
  (BUNSHIN_KMOD=1) against the library's own /proc/PID/pagemap path (BUNSHIN_KMOD=0, Cython);
  both answers must be equal.
- fork: Template.fork of a 5-process workspace (init, a shell with two background jobs, a
  Python process), and of issue 3's small workspace (init and a shell), with the module (each
  process cloned by FORK in the kernel, straight into the child under its init, then
  REPARENTed: exact parent links; each clone's fixups made by it in the kernel, RUN), with
  FORK but fixups injected (BUNSHIN_KMOD_RUN=0), with the module but cloning by injection
  (BUNSHIN_KMOD_FORK=0: REPARENT only), and with the user-space engine alone; also the time of
  one process's clone (Cloner.clone) on each path, and the rest of each child's fork
  (its init, the fixups inside its clones, the hand-out): the same Python on every path (the
  fixups' system calls made by RUN with the module, injected without), so it bounds how much
  faster the module's FORK can make a whole fork; and the time outside all the module's
  verbs (FORK, RUN, REPARENT, JOIN_SESSION), which bounds what any faster module could give.

Rounds alternate the backends; under QEMU/TCG only the ratios mean anything. Needs root, a
cgroup hierarchy and a state directory (guest-tests.sh provides them). The last line of output
is the JSON result.
"""
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time

import bunshin
from bunshin._core import kmod
from bunshin.memory import pids_usage

ROUNDS = 15
ACCOUNTING_ROUNDS = 15
FAMILY_MIB = 64
CHILDREN = 3
FORKS = 2

FAMILY = r"""
import mmap, os, sys, time
size = int(sys.argv[1])
buf = mmap.mmap(-1, size)
for off in range(0, size, 4096):
    buf[off] = 1
for i in range(int(sys.argv[2])):
    if os.fork() == 0:
        for off in range(0, size // 2 if i % 2 else 0, 4096):
            buf[off] = 2
        print(os.getpid(), flush=True)
        time.sleep(1000)
        os._exit(0)
print(os.getpid(), flush=True)
time.sleep(1000)
"""


def backend(mode):
    """mode "1": the module, all verbs; "norun": without RUN; "reparent": without FORK (and
    so RUN); "0": none."""
    os.environ[kmod.ENV] = "0" if mode == "0" else "1"
    os.environ[kmod.FORK_ENV] = "0" if mode == "reparent" else "1"
    os.environ[kmod.RUN_ENV] = "0" if mode == "norun" else "1"
    # the user-space engine's clones as the module's are made (Cloner.clone, timed here): a
    # flat tree; the exact one (fork/tree.py) copies parents, which no module path does
    os.environ["BUNSHIN_TREE"] = "flat" if mode == "0" else "exact"
    kmod.reset()
    return kmod.backend()


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def bench_accounting():
    p = subprocess.Popen([sys.executable, "-c", FAMILY, str(FAMILY_MIB << 20), str(CHILDREN)],
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = sorted(int(p.stdout.readline()) for _ in range(CHILDREN + 1))
        os.killpg(p.pid, signal.SIGSTOP)
        time.sleep(0.5)
        groups = {f"ws{i}": [pid] for i, pid in enumerate(pids)}
        groups["ws0"].append(groups.pop(f"ws{CHILDREN}")[0])  # one workspace of two processes
        times = {"1": [], "0": []}
        answers = {}
        for _ in range(ACCOUNTING_ROUNDS):
            for mode in ("1", "0"):
                backend(mode)
                dt, answers[mode] = timed(lambda: pids_usage(groups, pss=False))
                times[mode].append(dt)
        if answers["1"] != answers["0"]:
            sys.exit(f"GROUP_STATS and pagemap disagree:\n{answers['1']}\n{answers['0']}")
        k, u = statistics.median(times["1"]), statistics.median(times["0"])
        return {"processes": len(pids), "workspaces": len(groups),
                "total_mib": round(answers["0"].total_bytes / 2**20, 1),
                "shared_mib": round(answers["0"].shared_bytes / 2**20, 1),
                "kmod_median_s": round(k, 6), "pagemap_median_s": round(u, 6),
                "pagemap_over_kmod": round(u / k, 2)}
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


class CloneTimer:
    """Time spent in Cloner.clone per clone (one template process into each child)."""

    def __init__(self):
        from bunshin.fork.cloners import Cloner

        self.cls, self.inner, self.spent = Cloner, Cloner.clone, []
        inner, spent = self.inner, self.spent

        def clone(cl, source, proc, child_inits, *rest):
            t = time.perf_counter()
            try:
                return inner(cl, source, proc, child_inits, *rest)
            finally:  # per clone: FORK makes all the children's in one call
                spent.append((time.perf_counter() - t) / len(child_inits))

        Cloner.clone = clone

    def take(self):
        out = self.spent[:]
        self.spent.clear()
        return out

    def close(self):
        self.cls.clone = self.inner


class IoctlTimer:
    """Time spent in the module's fork verbs (FORK, RUN, REPARENT, JOIN_SESSION: the ioctl and
    its thin wrapper), in all: what the module itself costs a fork."""

    VERBS = ("fork", "run", "reparent", "join_session")

    def __init__(self):
        self.inner = {v: getattr(kmod.Kmod, v) for v in self.VERBS}
        self.spent = 0.0
        for v, fn in self.inner.items():
            setattr(kmod.Kmod, v, self._timed(fn))

    def _timed(self, fn):
        def timed_verb(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.spent += time.perf_counter() - t
        return timed_verb

    def take(self):
        out, self.spent = self.spent, 0.0
        return out

    def close(self):
        for v, fn in self.inner.items():
            setattr(kmod.Kmod, v, fn)


def bench_fork(small=False):
    clone_timer = CloneTimer()
    ioctl_timer = IoctlTimer()
    ws = bunshin.Workspace.create()
    try:
        if small:
            ws.shell().run("true")
        else:
            ws.shell().run("sleep 1000 & sleep 1001 &")
            ws.spawn(["python3", "-c", "import time; time.sleep(1000)"])
        time.sleep(1)
        nproc = len(ws.processes())
        # the template is a fork of ws: made with the module, its tree is ws's (the check below
        # asks each mode's children for it); a previous bench may have left another backend on
        backend("1")
        tpl = ws.snapshot()
        try:
            modes = ("1", "norun", "reparent", "0")
            times = {m: [] for m in modes}
            clones = {m: [] for m in modes}
            rest = {m: [] for m in modes}  # per child: the fork outside Cloner.clone
            python = {m: [] for m in modes}  # per child: the fork outside the module's verbs
            for _ in range(ROUNDS):
                for mode in modes:
                    b = backend(mode)
                    if (b.fork is not None) != (mode in ("1", "norun")):
                        sys.exit(f"mode {mode}: FORK {'not ' if b.fork is None else ''}in use")
                    if (b.run is not None) != (mode == "1"):
                        sys.exit(f"mode {mode}: RUN {'not ' if b.run is None else ''}in use")
                    clone_timer.take()
                    ioctl_timer.take()
                    dt, kids = timed(lambda: tpl.fork(FORKS))
                    times[mode].append(dt / FORKS)
                    spent = clone_timer.take()  # per process, per child
                    clones[mode] += spent
                    rest[mode].append(dt / FORKS - sum(spent))
                    python[mode].append((dt - ioctl_timer.take()) / FORKS)
                    ppids = {p.pid: p.ppid for p in kids[0].processes()}
                    for k in kids:
                        k.close()
                    exact = sum(1 for v in ppids.values() if v not in (0, 1))
                    if not small and (mode != "0") != (exact == 2):  # the jobs under bash
                        sys.exit(f"mode {mode}: parent links {ppids}")
        finally:
            tpl.close()
    finally:
        ws.close()
        clone_timer.close()
        ioctl_timer.close()
    med = {m: statistics.median(times[m]) for m in modes}
    cmed = {m: statistics.median(clones[m]) for m in modes}
    rmed = {m: statistics.median(rest[m]) for m in modes}
    pmed = statistics.median(python["1"])
    return {"processes": nproc, "forks_per_call": FORKS,
            "kmod_fork_median_ms": round(med["1"] * 1e3, 2),
            "no_run_fork_median_ms": round(med["norun"] * 1e3, 2),
            "reparent_only_fork_median_ms": round(med["reparent"] * 1e3, 2),
            "user_fork_median_ms": round(med["0"] * 1e3, 2),
            "user_over_kmod": round(med["0"] / med["1"], 3),
            "no_run_over_kmod": round(med["norun"] / med["1"], 3),
            "reparent_only_over_kmod": round(med["reparent"] / med["1"], 3),
            "kmod_clone_process_median_ms": round(cmed["1"] * 1e3, 3),
            "reparent_only_clone_process_median_ms": round(cmed["reparent"] * 1e3, 3),
            "user_clone_process_median_ms": round(cmed["0"] * 1e3, 3),
            "clone_user_over_kmod": round(cmed["0"] / cmed["1"], 2),
            # what FORK cannot touch: each child's init, the fixups in every clone (RUN with
            # the module, ptrace batches without), the hand-out. user_over_kmod could reach
            # user_over_kmod_if_fork_were_free at most, were the module's clones free.
            "kmod_outside_clone_median_ms": round(rmed["1"] * 1e3, 3),
            "user_outside_clone_median_ms": round(rmed["0"] * 1e3, 3),
            "user_over_kmod_if_fork_were_free": round(med["0"] / rmed["1"], 3),
            # and were every verb of the module (FORK, RUN, REPARENT, JOIN_SESSION) free: the
            # bound on any faster module, set by the rest of the fork (the library's Python
            # and its own system calls, the same on both paths)
            "kmod_outside_verbs_median_ms": round(pmed * 1e3, 3),
            "user_over_kmod_if_module_were_free": round(med["0"] / pmed, 3)}


def main():
    if backend("1").run is None:
        sys.exit("the module lacks RUN, FORK or REPARENT of traced clones")
    out = {"bench": "kmod_vs_user_space",
           "machine": f"qemu-tcg guest {platform.release()}, host {os.environ.get('BUNSHIN_HOST', '?')}",
           "rounds": {"accounting": ACCOUNTING_ROUNDS, "fork": ROUNDS},
           "accounting": bench_accounting(), "fork": bench_fork(),
           "fork_small": bench_fork(small=True)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
