"""Shared and private memory of a fork family, from the PFNs its processes map.

Two backends give the same answer: the kernel module's GROUP_STATS walks the page tables in the
kernel when /dev/bunshin is loaded (``bunshin._core.backend()``; ``BUNSHIN_KMOD=0`` turns it
off), else /proc/PID/pagemap is read and counted here.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .._core import _pagemap
from .._core.kmod import backend
from ..errors import PermissionDenied
from .pagemap import PAGE_SIZE, read_pfns

__all__ = ["FamilyUsage", "Usage", "family_usage", "pids_usage"]


@dataclass(frozen=True)
class Usage:
    """Memory of one workspace (a set of host pids) within its family, in bytes."""

    rss_bytes: int
    """Resident pages its processes map, each physical page counted once."""
    private_bytes: int
    """Pages no other member of the family maps."""
    shared_bytes: int
    """Pages that some other member of the family also maps."""
    pss_bytes: int | None
    """Sum of the kernel's Pss (smaps_rollup) over its processes, for comparison (None when
    not asked for)."""


@dataclass(frozen=True)
class FamilyUsage:
    """Memory of a whole family, in bytes: shared pages counted once."""

    total_bytes: int
    """Distinct physical pages the family maps (a huge page counts as its 4 KiB pages)."""
    shared_bytes: int
    """Distinct pages mapped by two or more members."""
    per_workspace: dict[str, Usage]
    """Each member's usage, keyed by workspace id or the label passed in."""
    pss_bytes: int | None
    """Sum of every member's ``pss_bytes`` (None when not asked for)."""


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            data = f.read()
    except OSError:
        return 0  # exited meanwhile (its pages are gone too)
    i = data.find(b"\nPss:")
    return int(data[i + 5 : data.index(b"kB", i)]) * 1024 if i >= 0 else 0


def _check_groups(groups: Mapping[str, Sequence[int]]) -> list[tuple[str, list[int]]]:
    from . import AccountingError, _check_pid

    if not isinstance(groups, Mapping):
        raise AccountingError(f"groups must map a label to a sequence of pids, got {type(groups).__name__}")
    out: list[tuple[str, list[int]]] = []
    owner: dict[int, str] = {}
    for label, pids in groups.items():
        if not isinstance(label, str):
            raise AccountingError(f"group labels must be str, got {label!r}")
        if isinstance(pids, (str, bytes)) or not isinstance(pids, Iterable):
            raise AccountingError(f"group {label!r}: pids must be a sequence of int, got {pids!r}")
        pids = [_check_pid(p) for p in pids]
        for p in pids:
            if owner.setdefault(p, label) != label:
                raise AccountingError(f"pid {p} is in both group {owner[p]!r} and group {label!r}")
        out.append((label, list(dict.fromkeys(pids))))
    return out


def _sample(pid: int, pss: bool) -> tuple[np.ndarray, int] | None:
    pfns = read_pfns(pid)
    if pfns is None:
        return None
    return pfns, _pss(pid) if pss else 0


def _sample_all(pids: list[int], pss: bool) -> list[tuple[np.ndarray, int] | None]:
    # The kernel's page-table walks dominate and run without the GIL: one thread per core
    workers = min(len(pids), os.cpu_count() or 1)
    if workers < 2:
        return [_sample(p, pss) for p in pids]
    with ThreadPoolExecutor(workers, thread_name_prefix="bunshin-memory") as ex:
        return list(ex.map(_sample, pids, [pss] * len(pids)))


def _has_mm(pid: int) -> bool:
    """Running with an address space (not exited, not a zombie, not a kernel thread)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            return bool(f.read(1))
    except OSError:
        return False


def _kernel_counts(checked: list[tuple[str, list[int]]]):
    """(rss, shared, total, shared_total) in pages from the module's GROUP_STATS, or None when
    it is not there or cannot answer this question (the pagemap path then does)."""
    k = backend().group_stats
    if k is None:
        return None
    members = [(g, pid) for g, (_, pids) in enumerate(checked) for pid in pids]
    for _ in range(4):
        live = sorted({g for g, _ in members})
        if not live:
            z = np.zeros(len(checked), dtype=np.int64)
            return z, z.copy(), 0, 0
        index = {g: i for i, g in enumerate(live)}
        try:
            shared_total, total, _, usage = k.group_stats(
                [pid for _, pid in members], [index[g] for g, _ in members], len(live))
        except OSError as e:
            if e.errno == errno.ESRCH:  # a pid exited meanwhile: skipped, as pagemap does
                members = [(g, pid) for g, pid in members if _has_mm(pid)]
                continue
            if e.errno == errno.EPERM:
                raise PermissionDenied("/dev/bunshin GROUP_STATS needs CAP_SYS_ADMIN and ptrace "
                                       "access to every process (run as root)") from None
            # EINVAL (one address space in two workspaces), E2BIG (over 4096 pids), ...
            return None
        rss = np.zeros(len(checked), dtype=np.int64)
        shared = np.zeros(len(checked), dtype=np.int64)
        rss[live] = usage[:, 1]
        shared[live] = usage[:, 2]
        return rss, shared, int(total), int(shared_total)
    return None  # pids keep exiting under us: let the pagemap path count what is left


def pids_usage(groups: Mapping[str, Sequence[int]], *, pss: bool = True) -> FamilyUsage:
    """Account a family given as ``{label: [host pid, ...]}``, one entry per workspace.

    A pid that is not running (exited meanwhile, or never existed: the kernel cannot tell the
    two apart) is skipped, so a sampler never fails because a tool call ended. A pid listed in
    two groups is an error. ``pss=False`` skips the kernel's Pss walk (half the cost) and
    leaves every ``pss_bytes`` None. Needs root (PFNs are hidden from others).
    """
    checked = _check_groups(groups)
    pss_sum = [0] * len(checked)  # summed only when pss
    counted = _kernel_counts(checked)
    if counted is not None:
        rss, shared, total, shared_total = counted
        if pss:
            for g, (_, pids) in enumerate(checked):
                pss_sum[g] = sum(_pss(pid) for pid in pids)
    else:
        rss, shared, total, shared_total = _pagemap_counts(checked, pss, pss_sum)
    per = {
        label: Usage(rss_bytes=int(rss[g]) * PAGE_SIZE,
                     private_bytes=int(rss[g] - shared[g]) * PAGE_SIZE,
                     shared_bytes=int(shared[g]) * PAGE_SIZE,
                     pss_bytes=pss_sum[g] if pss else None)
        for g, (label, _) in enumerate(checked)
    }
    return FamilyUsage(total_bytes=total * PAGE_SIZE, shared_bytes=shared_total * PAGE_SIZE,
                       per_workspace=per, pss_bytes=sum(pss_sum) if pss else None)


def _pagemap_counts(checked: list[tuple[str, list[int]]], pss: bool, pss_sum: list[int]):
    owners = [(g, pid) for g, (_, pids) in enumerate(checked) for pid in pids]
    parts, gids = [], []
    for (g, _), got in zip(owners, _sample_all([pid for _, pid in owners], pss)):
        if got is None:
            continue
        parts.append(got[0])
        gids.append(g)
        if pss:
            pss_sum[g] += got[1]
    top = max((int(p.max()) for p in parts if p.size), default=0)
    return _pagemap.count_family(parts, np.array(gids, dtype=np.int_), len(checked), top)


def family_usage(workspaces: Iterable[object] | Mapping[str, object], *, pss: bool = True) -> FamilyUsage:
    """Account workspaces (anything with ``.id`` and ``.host_pids()``, such as
    :class:`bunshin.Workspace`); a mapping ``{label: workspace}`` chooses the labels.
    See :func:`pids_usage`."""
    from . import AccountingError

    items: Iterable[tuple[str, object]]
    if isinstance(workspaces, Mapping):
        items = workspaces.items()
    else:
        if not isinstance(workspaces, Iterable):
            raise AccountingError(f"workspaces must be an iterable of workspaces, got {workspaces!r}")
        named = []
        for ws in workspaces:
            if not hasattr(ws, "id"):
                raise AccountingError(f"{ws!r} is not a workspace: it has no .id")
            named.append((str(ws.id), ws))
        items = named
    groups: dict[str, list[int]] = {}
    for label, ws in items:
        host_pids = getattr(ws, "host_pids", None)
        if not callable(host_pids):
            raise AccountingError(f"{ws!r} is not a workspace: it has no .host_pids()")
        if label in groups:
            raise AccountingError(f"workspace {label!r} is listed twice")
        groups[label] = list(host_pids())
    return pids_usage(groups, pss=pss)
