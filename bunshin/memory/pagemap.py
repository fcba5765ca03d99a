"""Physical pages of one process: /proc/PID/maps ranges read through /proc/PID/pagemap.

Only pages present in RAM count (swapped-out pages take no RAM). The zero page
(and the huge zero page) is left out: it is one read-only page of zeros the kernel maps wherever
untouched anonymous memory is read, and nobody pays for it.

Ranges of 1 GiB or more (runtime reservations: V8 cages, Go arenas, Java heaps) go through the
kernel's PAGEMAP_SCAN ioctl (Linux 6.7+) first, which skips their holes and zero-page runs;
smaller ranges are read whole, since on dense memory the extra walk costs ~40 % more.
``BUNSHIN_PAGEMAP_SCAN`` overrides: ``0`` never scans, ``all`` scans every range (the test
suite runs all three).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import struct

import numpy as np

from .. import config
from .._core import _pagemap
from ..errors import PermissionDenied

__all__ = ["PAGE_SIZE", "process_pfns", "read_pfns", "scan_from", "scan_supported", "zero_pfns"]

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
_PM_PRESENT = 1 << 63
_PFN_MASK = (1 << 55) - 1
_KPF_ZERO_PAGE = 1 << 24
_MADV_HUGEPAGE = 14
_HPAGE = 2 << 20
_GONE = (errno.ESRCH, errno.ENOENT)
_NO_RANGES = np.empty((0, 2), dtype=np.uint64)
_SCAN_FROM = 1 << 30
_NEVER = (1 << 64) - 1


def _entry(addr: int) -> int:
    """This process's pagemap entry for ``addr``."""
    with open("/proc/self/pagemap", "rb", buffering=0) as f:
        return struct.unpack("<Q", os.pread(f.fileno(), 8, addr // PAGE_SIZE * 8))[0]


def _is_zero_page(pfn: int) -> bool | None:
    """What /proc/kpageflags says about ``pfn`` (None: cannot tell)."""
    try:
        with open("/proc/kpageflags", "rb", buffering=0) as f:
            return bool(struct.unpack("<Q", os.pread(f.fileno(), 8, pfn * 8))[0] & _KPF_ZERO_PAGE)
    except (OSError, struct.error):
        return None


def _probe_read(length: int, offset: int, huge: bool) -> int:
    """PFN mapped after reading one byte of fresh private anonymous memory (0 if none)."""
    m = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        ref = ctypes.c_char.from_buffer(m)
        base = ctypes.addressof(ref)
        del ref
        addr = (base + offset + _HPAGE - 1) & ~(_HPAGE - 1) if huge else base + offset
        if huge:
            m.madvise(_MADV_HUGEPAGE, addr - base, _HPAGE)
        m[addr - base]  # a read fault maps the (huge) zero page, it allocates nothing
        e = _entry(addr)
        return e & _PFN_MASK if e & _PM_PRESENT else 0
    finally:
        m.close()


@functools.cache
def zero_pfns() -> tuple[int, int, int]:
    """(zero_pfn, huge_lo, huge_hi): the zero page's PFN and the huge zero page's PFN range
    [huge_lo, huge_hi) (empty when THP does not use one or it cannot be confirmed)."""
    zero = _probe_read(PAGE_SIZE, 0, huge=False)
    if zero == 0:
        raise PermissionDenied("reading PFNs from /proc/PID/pagemap needs CAP_SYS_ADMIN (run as root)")
    lo = hi = 0
    try:
        hz = _probe_read(2 * _HPAGE, 0, huge=True)
    except (OSError, ValueError):
        hz = 0
    # Only trust it when the kernel confirms: a real huge page would be freed and reused.
    if hz and hz != zero and _is_zero_page(hz):
        lo, hi = hz, hz + _HPAGE // PAGE_SIZE
    return zero, lo, hi


@functools.cache
def scan_supported() -> bool:
    """Whether this kernel has the PAGEMAP_SCAN ioctl (with the PFNZERO category)."""
    zp = zero_pfns()
    buf = mmap.mmap(-1, PAGE_SIZE)
    try:
        ref = ctypes.c_char.from_buffer(buf)
        base = ctypes.addressof(ref)
        del ref
        fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        try:
            rng = np.array([[base, base + PAGE_SIZE]], dtype=np.uint64)
            _pagemap.present_pfns(fd, rng, *zp, 0)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
    finally:
        buf.close()


def scan_from() -> int:
    """Ranges at least this many bytes long are read through PAGEMAP_SCAN (2**64-1: none)."""
    mode = config.pagemap_scan()
    if mode == "0" or not scan_supported():
        return _NEVER
    return 0 if mode == "all" else _SCAN_FROM


def _ranges(maps: bytes) -> np.ndarray:
    out = []
    for line in maps.splitlines():
        if line.endswith(b"[vsyscall]"):  # fixed kernel page, outside the user address space
            continue
        a, _, rest = line.partition(b"-")
        out.append((int(a, 16), int(rest[: rest.index(b" ")], 16)))
    return np.array(out, dtype=np.uint64).reshape(-1, 2) if out else _NO_RANGES


def read_pfns(pid: int) -> np.ndarray | None:
    """Present PFNs of ``pid`` (uint64, in address order, with repeats), or None if it has
    exited. Raises PermissionDenied when the PFNs are hidden from this process."""
    try:
        dfd = os.open(f"/proc/{pid}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        # maps and pagemap through one directory fd: both describe the same process even if
        # the pid is reused meanwhile
        fd = os.open("pagemap", os.O_RDONLY | os.O_CLOEXEC, dir_fd=dfd)
        try:
            with open(os.open("maps", os.O_RDONLY | os.O_CLOEXEC, dir_fd=dfd), "rb") as f:
                ranges = _ranges(f.read())
            pfns, hidden = _pagemap.present_pfns(fd, ranges, *zero_pfns(), scan_from())
        finally:
            os.close(fd)
    except PermissionError as e:
        raise PermissionDenied(f"cannot read /proc/{pid}/pagemap: {e.strerror} (needs root with ptrace "
                               "access to the process)") from None
    except OSError as e:
        if e.errno in _GONE:
            return None
        raise
    finally:
        os.close(dfd)
    if hidden:
        raise PermissionDenied(f"/proc/{pid}/pagemap hides PFNs from this process "
                               "(needs CAP_SYS_ADMIN in the initial user namespace)")
    return pfns


def process_pfns(pid: int) -> np.ndarray:
    """Present PFNs (uint64, sorted, distinct) of one process; empty if it has exited.

    Zero-page mappings are left out; a transparent huge page counts as its 4 KiB pages.
    """
    from . import _check_pid

    pfns = read_pfns(_check_pid(pid))
    return np.empty(0, dtype=np.uint64) if pfns is None else np.unique(pfns)
