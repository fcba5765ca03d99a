"""cgroupfs file access with kernel errors translated into Bunshin errors, and mountinfo parsing."""

from __future__ import annotations

import errno
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from ...errors import BunshinError, CgroupError, LimitError, PermissionDenied

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@+-]{0,199}")
_OCTAL_RE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class Mount:
    """One line of a mountinfo file."""

    point: str
    root: str  # the path of the file system's tree mounted at ``point``
    fstype: str
    options: frozenset[str]  # the super block's
    device: str  # "major:minor"


def mounts(mountinfo: str = "/proc/self/mountinfo") -> list[Mount]:
    """Every mount ``mountinfo`` lists, in mount order."""
    found = []
    with open(mountinfo) as f:
        for line in f:
            # Optional fields vary in number, so split around the " - " separator.
            head, _, tail = line.rstrip("\n").partition(" - ")
            fields, rest = head.split(), tail.split()
            if len(fields) < 5 or len(rest) < 3:
                continue
            found.append(Mount(_unescape(fields[4]), _unescape(fields[3]), rest[0],
                               frozenset(rest[2].split(",")), fields[2]))
    return found


def _unescape(field: str) -> str:
    """A mountinfo path field as the path it names (the kernel writes space, tab, newline and
    backslash as octal escapes)."""
    return _OCTAL_RE.sub(lambda m: chr(int(m.group(1), 8)), field)


def cgroup_mounts(mountinfo: str = "/proc/self/mountinfo") -> list[Mount]:
    """Every cgroup (v1) and cgroup2 mount visible to this process, in mount order."""
    return [m for m in mounts(mountinfo) if m.fstype in ("cgroup", "cgroup2")]


def check_name(name: object, what: str = "cgroup name") -> str:
    """Reject names that are not a single safe directory name."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name.startswith("cgroup."):
        raise CgroupError(
            f"{what} {name!r} is not usable: give 1-200 characters of letters, digits and "
            f"'_.@+-', not starting with '.', '-' or 'cgroup.'"
        )
    return name


def translate(err: OSError, action: str) -> BunshinError:
    """Turn ``err`` (raised while doing ``action``) into the Bunshin error a user can act on."""
    where = f"{action}: {err.filename}" if err.filename else action
    if err.errno in (errno.EACCES, errno.EPERM):
        return PermissionDenied(
            f"{where}: permission denied; Bunshin needs root (CAP_SYS_ADMIN) to manage cgroups, "
            f"run it as root"
        )
    if err.errno == errno.EROFS:
        return PermissionDenied(f"{where}: cgroupfs is mounted read-only; remount it read-write")
    if err.errno == errno.ENOENT:
        return CgroupError(f"{where}: no such cgroup file; the cgroup was removed or never made")
    return CgroupError(f"{where}: {os.strerror(err.errno or 0)}")


def read(path: str) -> str:
    """Contents of a cgroup file, stripped."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        raise translate(e, "reading cgroup file") from None


def read_keyed(path: str) -> dict[str, int]:
    """A flat-keyed cgroup file (``key value`` per line) such as memory.events or pids.events."""
    out = {}
    for line in read(path).splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


def write(path: str, value: str, *, limit: str | None = None) -> None:
    """Write ``value`` to a cgroup file; with ``limit`` set, bad values raise LimitError."""
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)
    except OSError as e:
        if limit and e.errno in (errno.EINVAL, errno.EBUSY, errno.ERANGE):
            busy = e.errno == errno.EBUSY
            why = "is below what the group already uses" if busy else "was refused"
            raise LimitError(
                f"{limit}: writing {value!r} to {path} {why} ({os.strerror(e.errno)}); "
                f"choose a different value"
            ) from None
        raise translate(e, f"writing {value!r}") from None


def read_procs(path: str) -> list[int]:
    """The pids in a ``cgroup.procs`` file; an already removed group has none.

    A task that is exiting has lost its pid and is listed as 0; kill(0) would signal our
    own process group, so such entries are dropped.
    """
    try:
        with open(path) as f:
            return [p for p in map(int, f.read().split()) if p > 0]
    except FileNotFoundError:
        return []
    except OSError as e:
        raise translate(e, "reading members") from None


def tree_procs(top: str) -> list[int]:
    """Member pids of ``top`` and every cgroup below it."""
    pids: set[int] = set()
    for d, _, _ in os.walk(top):
        pids.update(read_procs(os.path.join(d, "cgroup.procs")))
    return sorted(pids)


def rmdir_tree(top: str) -> bool:
    """Remove ``top`` and its child cgroups bottom-up; False while members keep one busy.

    A missing ``top`` counts as removed, so removal is idempotent.
    """
    for d, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):
        try:
            os.rmdir(d)
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno in (errno.EBUSY, errno.ENOTEMPTY):
                return False
            raise translate(e, "removing cgroup") from None
    return True


def mkdir(path: str) -> bool:
    """Create a cgroup directory; True if this call created it."""
    try:
        os.mkdir(path)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        raise translate(e, "creating cgroup") from None


def wait_for(cond: Callable[[], bool], timeout: float) -> bool:
    """Poll ``cond`` with a growing interval until it holds or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    delay = 0.00005  # a freeze of idle tasks settles in well under a millisecond
    while True:
        if cond():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
