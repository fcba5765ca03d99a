"""How much memory a fork family uses: private, shared, and the true total.

Workspaces forked copy-on-write share physical pages until one side writes. This package reads
which physical pages (PFNs) each process maps, from /proc/PID/pagemap, and counts them per
workspace and across the family, each page once:

>>> from bunshin.memory import family_usage
>>> u = family_usage([ws1, ws2])            # doctest: +SKIP
>>> u.total_bytes, u.per_workspace[ws1.id].private_bytes   # doctest: +SKIP

Only resident pages count; the zero page does not (see :mod:`bunshin.memory.pagemap`).
Needs root. A pid that is no longer running is skipped, never an error.
"""

from __future__ import annotations

from ..errors import BunshinError
from .family import FamilyUsage, Usage, family_usage, pids_usage
from .pagemap import process_pfns

__all__ = ["AccountingError", "FamilyUsage", "Usage", "family_usage", "pids_usage", "process_pfns"]


class AccountingError(BunshinError):
    """Memory accounting was given something it cannot account (not a pid, a pid twice)."""


def _check_pid(pid: object) -> int:
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise AccountingError(f"a pid must be a positive int, got {pid!r}")
    return pid
