"""Parse and validate the resource limits a workspace's cgroup can carry.

Each parser returns the value in kernel units, or ``None`` for "no limit", and raises
:class:`~bunshin.errors.LimitError` naming the argument and the accepted forms otherwise.

``memory_limit``
    bytes as an ``int``, or a string: a number, optionally with a fraction, followed by an
    optional unit ``B``, ``K``, ``M``, ``G`` or ``T``, each optionally followed by ``i`` and/or
    ``B`` (``"512M"``, ``"2G"``, ``"1.5GiB"``, ``"64mb"``; case does not matter). Every unit is
    binary: ``K`` = ``KB`` = ``KiB`` = 1024 bytes, as in ``docker run --memory``. A fraction of
    a byte is dropped. The limit must be at least :data:`MIN_MEMORY` (4 MiB): below that not even
    the workspace's init and a shell fit, and the kernel would OOM-kill them at once.
``pids_limit``
    an ``int`` >= 1: the most tasks (processes and threads) the group may hold.
``cpu_limit``
    the number of CPUs the group may use, an ``int`` or ``float`` >= :data:`MIN_CPUS`; ``1.5``
    means 150 ms of CPU time every :data:`CPU_PERIOD_US` (100 ms) period.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from types import EllipsisType

from ...errors import LimitError

__all__ = [
    "CPU_PERIOD_US",
    "MIN_CPUS",
    "MIN_MEMORY",
    "Limits",
    "cpu_quota_us",
    "parse_cpu",
    "parse_memory",
    "parse_pids",
]

MIN_MEMORY = 4 << 20
CPU_PERIOD_US = 100_000
# The kernel refuses CFS quotas under 1 ms; with a 100 ms period that is 1% of a CPU.
MIN_CPUS = 0.01
# Both cgroup versions store limits as signed 64-bit byte counts.
_MAX_BYTES = (1 << 63) - 1

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_MEMORY_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(?:i?b)?|b)?\s*", re.IGNORECASE)
_MEMORY_FORMS = (
    "bytes as an int (e.g. 268435456) or a string such as '512M', '2G', '1.5GiB' "
    "(units B, K, M, G, T, optionally with 'i'/'B'; all powers of 1024), or {} for no limit"
)


def parse_memory(value: object, *, arg: str = "memory_limit", no_limit: str = "None") -> int | None:
    """Return ``value`` as a byte count (``None`` stays ``None``); see the module docstring.
    ``no_limit``: what the caller takes for no limit, as its messages name it."""
    forms = _MEMORY_FORMS.format(no_limit)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise LimitError(f"{arg}={value!r}: expected {forms}")
    if isinstance(value, str):
        m = _MEMORY_RE.fullmatch(value)
        if m is None or ("." in m.group(1) and m.group(2) is None):
            raise LimitError(f"{arg}={value!r} is not a memory size; expected {forms}")
        nbytes = int(Fraction(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    else:
        nbytes = value
    if nbytes < MIN_MEMORY:
        raise LimitError(
            f"{arg}={value!r} is below the minimum of {MIN_MEMORY} bytes (4M); "
            f"give at least '4M', or {no_limit} for no limit"
        )
    if nbytes > _MAX_BYTES:
        raise LimitError(f"{arg}={value!r} exceeds 2**63-1 bytes; use {no_limit} for no limit")
    return nbytes


def parse_pids(value: object, *, arg: str = "pids_limit") -> int | None:
    """Return ``value`` as a task count (``None`` stays ``None``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise LimitError(f"{arg}={value!r}: expected an int >= 1 (tasks), or None for no limit")
    if value < 1:
        raise LimitError(f"{arg}={value!r}: must be >= 1 (a workspace needs its init), or None")
    return value


def parse_cpu(value: object, *, arg: str = "cpu_limit") -> float | None:
    """Return ``value`` as a number of CPUs (``None`` stays ``None``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LimitError(f"{arg}={value!r}: expected a number of CPUs (e.g. 0.5, 2), or None")
    if not math.isfinite(value) or value < MIN_CPUS:
        raise LimitError(
            f"{arg}={value!r}: must be a finite number of CPUs >= {MIN_CPUS}, or None for no limit"
        )
    return float(value)


def cpu_quota_us(cpus: float) -> int:
    """CFS quota in microseconds per :data:`CPU_PERIOD_US` for ``cpus`` CPUs."""
    return max(1000, round(cpus * CPU_PERIOD_US))


@dataclass(frozen=True)
class Limits:
    """A cgroup's limits, parsed: ``None`` means no limit."""

    memory: int | None = None  #: bytes
    pids: int | None = None  #: tasks (processes and threads)
    cpu: float | None = None  #: CPUs

    @classmethod
    def parse(cls, memory_limit: object = None, pids_limit: object = None,
              cpu_limit: object = None) -> Limits:
        """Limits from the user's forms (see the module docstring); LimitError names a bad one."""
        return cls(parse_memory(memory_limit), parse_pids(pids_limit), parse_cpu(cpu_limit))

    def changed(self, memory: int | None | EllipsisType = ..., pids: int | None | EllipsisType = ...,
                cpu: float | None | EllipsisType = ...) -> Limits:
        """These limits with the parsed values given (``...`` keeps one as it is)."""
        return Limits(self.memory if memory is ... else memory, self.pids if pids is ... else pids,
                      self.cpu if cpu is ... else cpu)

    def to_dict(self) -> dict:
        """The keyword arguments of :meth:`CgroupBackend.create` (and an image's metadata)."""
        return {"memory_limit": self.memory, "pids_limit": self.pids, "cpu_limit": self.cpu}

    @classmethod
    def from_dict(cls, d: dict) -> Limits:
        return cls.parse(d.get("memory_limit"), d.get("pids_limit"), d.get("cpu_limit"))
