"""``bunshin doctor``: what this kernel offers Bunshin, and what each missing piece costs.

Exit status 0 means everything Bunshin *needs* works (mnt/pid/net/ipc/uts namespaces, overlayfs,
a cgroup freezer, clone3 with set_tid, ptrace); 1 means a workspace cannot be forked here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from . import kerndat
from .criu_locate import CriuInfo
from .kerndat import KernDat

__all__ = ["Check", "add_arguments", "backend_checks", "checks", "main", "missing_needs",
           "quota_checks"]

_REQUIRED_NS = ("mnt", "pid", "net", "ipc", "uts")
_NS_COST = {
    "user": "no user namespaces → no sandbox (the default isolation); only isolation='trusted'",
    "cgroup": "no cgroup namespaces → workspaces see the host's cgroup paths",
    "time": "no time namespaces → clones share the host's monotonic/boot clocks",
}


@dataclasses.dataclass(frozen=True)
class Check:
    """One line of the report. ``cost`` says what the user loses when ``ok`` is False."""

    name: str
    ok: bool
    required: bool
    detail: str
    cost: str


def _why(kd: KernDat, *probes: str) -> str:
    return "; ".join(kd.why[p] for p in probes if p in kd.why)


def _criu_checks(kd: KernDat) -> list[Check]:
    c = kd.criu
    if c is None:
        err = kd.why.get("criu")
        return [Check("CRIU ≥ 4", False, False, err or "not found",
                      "no CRIU → templates cannot spill to disk and the CRIU baseline is "
                      "unavailable; run `bunshin criu provision`")]
    version = ".".join(map(str, c.version))
    cost = "" if c.usable else f"CRIU {version} found and refused: {c.reason}"
    return [Check("CRIU ≥ 4", c.usable, False, f"{version} at {c.path} ({c.source})", cost),
            Check("CRIU driver", bool(c.pycriu_version), False, c.describe_driver(),
                  "no pycriu → CRIU cannot be driven: `bunshin criu provision` and "
                  "pip install 'bunshin[criu]' (protobuf)"),
            Check("CRIU build", True, False, c.describe_build() + _plugin_missing(c), "")]


def _plugin_missing(c: CriuInfo) -> str:
    """Why a CRIU runs without Bunshin's plugin; "" when it has it."""
    if c.plugins:
        return ""
    from .criu.plugin import plugin_info

    return f"; Bunshin's CRIU plugin is not in use: {plugin_info().reason}"


_USER_COST = {
    "fork clones": "each process of a fork is cloned by injected system calls (about ten ptrace "
                   "stops, an intermediate process); /dev/bunshin FORK clones it in the kernel, "
                   "into the child's namespaces and cgroups",
    "fork fixups": "every clone joins its namespaces and gets its descriptors through injected "
                   "system calls (three or four ptrace stops a process); /dev/bunshin RUN makes "
                   "them in the kernel in one",
    "fork sessions": "a clone joins its session as its parent's clone makes it (a parent with "
                     "children is copied into its clone: ~5 ms and its own memory per fork); "
                     "/dev/bunshin JOIN_SESSION puts it there in the kernel",
    "fork parents": "each clone is made by its parent's clone, which is then copied into the "
                    "parent (its memory, but for pages it shares with the child it was made "
                    "from); /dev/bunshin REPARENT moves clones instead",
    "memory accounting": "family_usage reads /proc/PID/pagemap: several times slower than "
                         "/dev/bunshin GROUP_STATS",
}


def backend_checks() -> list[Check]:
    """Which backend this process uses (``BUNSHIN_KMOD``: auto, 0, 1) and why; one row per job."""
    from ._core.kmod import ENV, KmodUnavailable, backend

    try:
        b = backend()
    except KmodUnavailable as e:
        return [Check("backend", False, False, str(e),
                      f"every fork and accounting call fails while {ENV}=1 and the module is unusable")]
    rows = [Check("backend", True, False, f"{b.name} ({ENV}={b.mode}): {b.reason}", "")]
    for job, how in b.uses.items():
        rows.append(Check(job, how.startswith("kmod"), False, how, _USER_COST[job]))
    return rows


def quota_checks() -> list[Check]:
    """Whether ``disk_limit`` is enforced: btrfs simple quotas, and the state file system's mode."""
    import os

    from . import config
    from .runtime import quota, statefs

    state = config.state_dir()
    mode = quota.mode(state) if os.path.ismount(state) else None
    on = f"; {state}: {mode}" if mode is not None else ""
    pending = mode == "disabled" and statefs.ours(state) is not None
    if pending:
        on += " (Bunshin's image: turned on with its next workspace)"
    if quota.supported():
        return [Check("disk quotas", mode in (None, "squota") or pending, False,
                      f"btrfs simple quotas{on}",
                      f"{state} is not in simple-quota mode → disk_limit is not enforced there")]
    return [Check("disk quotas", False, False, f"no btrfs simple quotas (Linux < 6.7){on}",
                  "disk_limit is not enforced: a workspace can fill the state file system (its "
                  "image is sized to leave the host's disk a reserve)")]


def checks(kd: KernDat) -> list[Check]:
    """Judge every probe of ``kd``; the order is the order of the report."""
    out = [Check("kernel", True, False, kd.release, "")]
    for ns in kerndat.NAMESPACES:
        ok = kd.namespaces.get(ns, False)
        need = ns in _REQUIRED_NS
        cost = (f"no {ns} namespace → workspaces cannot be isolated" if need else _NS_COST[ns])
        detail = _why(kd, f"ns_{ns}") or "unshare works"
        out.append(Check(f"{ns} namespace", ok, need, detail, cost))
    out.append(Check(
        "overlayfs", kd.overlayfs_listed and kd.overlayfs_mount, True,
        _why(kd, "overlayfs_mount") or ("listed and a test mount works" if kd.overlayfs_mount
                                         else "listed" if kd.overlayfs_listed else "not listed"),
        "no overlayfs → no copy-on-write root; workspaces cannot share layers"))
    # either way a sandbox works; what differs is whether its layers show in the mount table
    why = _why(kd, "overlayfs_detached_layer")
    out.append(Check(
        "sandbox layer views", True, False,
        "detached (overlayfs takes a detached idmapped layer)" if kd.overlayfs_detached_layer
        else f"attached under <state>/idmap while a sandbox runs (overlayfs refuses a detached "
             f"layer{': ' + why if why else ', as 6.1 does'})", ""))
    v1 = ", ".join(sorted(kd.cgroup_v1)) or "none"
    v2 = (f"v2 at {kd.cgroup_v2_mount} ({' '.join(kd.cgroup_v2_controllers) or 'no controllers'})"
          if kd.cgroup_v2_mount else "no v2")
    v2_full = "memory" in kd.cgroup_v2_controllers
    out.append(Check("cgroups", bool(kd.cgroup_v1 or kd.cgroup_v2_mount), True, f"v1: {v1}; {v2}",
                     "no cgroup hierarchy → no limits, no accounting, no freezer"))
    if kd.cgroup_v1 and not v2_full:
        out.append(Check("cgroup v2 controllers", True, False, "cgroup v1 only → fine", ""))
    kinds = [k for k, on in (("v1 freezer.state", kd.freezer_v1),
                             ("v2 cgroup.freeze", kd.freezer_v2)) if on]
    out.append(Check("cgroup freezer", kd.freezer, True,
                     ", ".join(kinds) or _why(kd, "freezer_v1", "freezer_v2") or "no freezer",
                     "no cgroup freezer → a workspace cannot be stopped whole to fork it"))
    from .runtime.cgroup import dynmods

    dyn = dynmods.active()
    out.append(Check("cgroup favordynmods", dyn, False,
                     "on: moving a task into a cgroup does not wait for an RCU grace period" if dyn
                     else "off; BUNSHIN_FAVOR_DYNMODS=0 keeps it so" if not dynmods.wanted()
                     else "off; Bunshin turns it on (until reboot) before its first cgroup",
                     "favordynmods off → a fork after a pause waits ~10 ms to move its first task"))
    out.append(Check("clone3 set_tid", kd.clone3_set_tid, True,
                     _why(kd, "clone3_set_tid") or "a child got the PID asked for",
                     "no clone3 set_tid → forks cannot keep PIDs"))
    scope = "no Yama" if kd.ptrace_scope is None else f"yama ptrace_scope={kd.ptrace_scope}"
    out.append(Check("ptrace", kd.ptrace_seize, True, _why(kd, "ptrace_seize") or scope,
                     f"ptrace refused ({scope}) → the fork engine cannot seize processes; "
                     "run as root or set kernel.yama.ptrace_scope to 1 or less"))
    out.append(Check("seccomp'd processes", kd.ptrace_suspend_seccomp, False,
                     _why(kd, "ptrace_suspend_seccomp") or "PTRACE_O_SUSPEND_SECCOMP allowed: a fork's "
                     "calls are not subject to the processes' filters",
                     "a process that adds a seccomp filter of its own cannot be forked (ForkError); "
                     "run the trainer with CAP_SYS_ADMIN and not under seccomp itself"))
    out.append(Check("pidfd_open", kd.pidfd_open, False, _why(kd, "pidfd_open") or "works",
                     "no pidfd_open → workspace processes are tracked by PID (racy on reuse)"))
    out.append(Check("pagemap PFNs + kpagecount", kd.pagemap_pfn and kd.kpagecount, False,
                     _why(kd, "pagemap") or ("PFNs visible, kpagecount readable" if kd.kpagecount
                                             else "PFNs hidden or kpagecount unreadable "
                                             "(needs CAP_SYS_ADMIN)"),
                     "no PFNs → shared-page accounting falls back to PSS from smaps_rollup"))
    uffd = kd.userfaultfd_syscall or kd.userfaultfd_dev
    uffd_detail = f"syscall={kd.userfaultfd_syscall} /dev/userfaultfd={kd.userfaultfd_dev}"
    if _why(kd, "userfaultfd_syscall", "userfaultfd_dev"):
        uffd_detail += f" ({_why(kd, 'userfaultfd_syscall', 'userfaultfd_dev')})"
    out.append(Check("userfaultfd", uffd, False, uffd_detail,
                     "no userfaultfd → spilled templates are restored eagerly, not lazily"))
    ksm_state = {0: "ksmd stopped", 1: "ksmd running", 2: "unmerging"}.get(kd.ksm_run or 0)
    ksm_detail = f"run={kd.ksm_run} ({ksm_state}), PR_SET_MEMORY_MERGE works" if kd.ksm else (
        "absent" if kd.ksm_run is None else f"run={kd.ksm_run}, PR_SET_MEMORY_MERGE refused")
    out.append(Check("KSM", kd.ksm, False, _why(kd, "ksm_prctl") or ksm_detail,
                     "no KSM → CRIU baseline without merging"))
    out.append(Check("transparent hugepages", kd.thp_mode in ("always", "madvise"), False,
                     kd.thp_mode or "absent",
                     "THP off → forking a large heap copies ~20× more page-table entries"))
    out.append(Check("RLIMIT_NOFILE", True, False, f"hard {kd.nofile_hard}; a trainer's soft limit "
                     "is raised to it with its first workspace", ""))
    out.append(Check("CAP_SYS_ADMIN", kd.cap_sys_admin, False, "effective" if kd.cap_sys_admin
                     else "absent", "not root → namespaces, mounts and cgroups are refused"))
    out.append(Check("CAP_SYS_RESOURCE", kd.cap_sys_resource, False,
                     "effective" if kd.cap_sys_resource else "absent",
                     "no CAP_SYS_RESOURCE → workspaces cannot get limits above the hard limits"))
    out.append(Check("loadable modules", kd.config_modules, False,
                     "/proc/modules present" if kd.config_modules else "CONFIG_MODULES off",
                     "no loadable modules → kmod/ cannot be loaded on this kernel"))
    abi = f"present, ABI v{kd.bunshin_abi}" if kd.bunshin_abi is not None else (
        "present, ABI version unknown" if kd.bunshin_dev else "absent")
    out.append(Check("/dev/bunshin", kd.bunshin_dev, False, abi,
                     "no /dev/bunshin → user-space fork engine (ptrace) is used; kmod/ makes "
                     "forks faster and parent links exact"))
    out.extend(backend_checks())
    out.extend(quota_checks())
    out.extend(_criu_checks(kd))
    return out


def missing_needs(kd: KernDat) -> list[Check]:
    """The required checks that failed; empty means Bunshin can run here."""
    return [c for c in checks(kd) if c.required and not c.ok]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``bunshin doctor``."""
    parser.add_argument("--json", action="store_true", help="print the probe results as JSON")
    parser.add_argument("--refresh", action="store_true", help="probe again, ignoring the cache")


def _render(kd: KernDat, rows: list[Check]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"bunshin doctor — Linux {kd.release}", title_justify="left")
    for col in ("check", "status", "detail", "if missing"):
        table.add_column(col, overflow="fold")
    for c in rows:
        status = ("[green]works" if c.ok else "[red]MISSING (needed)" if c.required
                  else "[yellow]missing")
        table.add_row(c.name, status, c.detail, "" if c.ok else c.cost)
    console = Console(width=max(Console().width, 120))
    console.print(table)
    lacking = [c.name for c in rows if c.required and not c.ok]
    console.print("[red]Bunshin cannot fork workspaces here: missing " + ", ".join(lacking)
                  if lacking else "[green]Everything Bunshin needs is here.")
    console.print(f"[dim]probed in {kd.probe_seconds * 1000:.0f} ms; cache: {kerndat.cache_path()}")


def main(args: argparse.Namespace) -> int:
    """Run ``bunshin doctor``; returns the exit status (0: all needs met, 1: something missing)."""
    kd = kerndat.get(refresh=getattr(args, "refresh", False))
    rows = checks(kd)
    if getattr(args, "json", False):
        json.dump(kd.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _render(kd, rows)
    return 1 if any(c.required and not c.ok for c in rows) else 0
