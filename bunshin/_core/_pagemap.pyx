# cython: language_level=3, boundscheck=False, wraparound=False
"""Hot loops of bunshin.memory: present PFNs of a process (from its /proc/PID/pagemap), and
the per-page counting that tells private from shared pages across a family.

The caller opens the pagemap file and passes the virtual ranges to read (from /proc/PID/maps).
Everything per page runs in C without the GIL. The kernel's PAGEMAP_SCAN ioctl (Linux 6.7+) can
first find the present, non-zero-page runs of a range, so sparse reservations (a 64 GiB
PROT_NONE arena) cost nothing; other ranges are read whole.
"""
from libc.stdint cimport uint64_t
from libc.stdlib cimport calloc, malloc, realloc, free
from libc.string cimport memcpy, memset
from libc.errno cimport errno, EINTR

import os

import numpy as np

cdef extern from "<unistd.h>" nogil:
    ssize_t pread(int fd, void *buf, size_t count, long offset)
    long sysconf(int name)
    int _SC_PAGESIZE

cdef extern from "<sys/ioctl.h>" nogil:
    int ioctl(int fd, unsigned long request, ...)

cdef extern from "pagemap_scan.h" nogil:
    struct bx_page_region:
        uint64_t start
        uint64_t end
        uint64_t categories
    struct bx_pm_scan_arg:
        uint64_t size
        uint64_t flags
        uint64_t start
        uint64_t end
        uint64_t walk_end
        uint64_t vec
        uint64_t vec_len
        uint64_t max_pages
        uint64_t category_inverted
        uint64_t category_mask
        uint64_t category_anyof_mask
        uint64_t return_mask
    unsigned long BX_PAGEMAP_SCAN
    uint64_t BX_PAGE_IS_PRESENT
    uint64_t BX_PAGE_IS_PFNZERO

cdef enum:
    CHUNK = 65536        # pagemap entries per pread: 512 KiB
    NREGIONS = 1024      # PAGEMAP_SCAN regions per ioctl
cdef uint64_t PM_PRESENT = 1ULL << 63
cdef uint64_t PFN_MASK = (1ULL << 55) - 1


cdef struct acc_t:
    uint64_t *out
    size_t n
    size_t cap
    size_t hidden        # present but PFN reads as 0: the reader lacks CAP_SYS_ADMIN
    uint64_t zero_pfn
    uint64_t hz_lo       # huge zero page PFN range [hz_lo, hz_hi), empty if unknown
    uint64_t hz_hi
    uint64_t *buf


cdef int _grow(acc_t *a, size_t need) noexcept nogil:
    cdef size_t cap = a.cap
    cdef uint64_t *p
    if a.n + need <= cap:
        return 0
    while cap < a.n + need:
        cap = cap * 2 if cap else 4096
    p = <uint64_t *>realloc(a.out, cap * 8)
    if p == NULL:
        return -1
    a.out, a.cap = p, cap
    return 0


cdef int _read_range(int fd, acc_t *a, uint64_t first, uint64_t npages) noexcept nogil:
    """Append present PFNs of virtual pages [first, first+npages); -errno on failure."""
    cdef uint64_t done = 0, want, got, i, e, pfn
    cdef ssize_t r
    while done < npages:
        want = npages - done
        if want > CHUNK:
            want = CHUNK
        r = pread(fd, a.buf, want * 8, <long>((first + done) * 8))
        if r < 0:
            if errno == EINTR:
                continue
            return -errno
        if r == 0:
            return 0  # the mm is gone (process exited) or the range lies past the end
        got = <uint64_t>r // 8
        if _grow(a, got) < 0:
            return -12  # ENOMEM
        for i in range(got):
            e = a.buf[i]
            if not (e & PM_PRESENT):
                continue
            pfn = e & PFN_MASK
            if pfn == 0:
                a.hidden += 1
            elif pfn != a.zero_pfn and not (a.hz_lo <= pfn < a.hz_hi):
                a.out[a.n] = pfn
                a.n += 1
        done += got
    return 0


cdef int _scan_range(int fd, acc_t *a, uint64_t start, uint64_t end, uint64_t psz,
                     bx_page_region *vec) noexcept nogil:
    cdef bx_pm_scan_arg arg
    cdef long r, k
    cdef int err
    while start < end:
        memset(&arg, 0, sizeof(arg))
        arg.size = sizeof(arg)
        arg.start, arg.end = start, end
        arg.vec, arg.vec_len = <uint64_t>vec, NREGIONS
        arg.category_inverted = BX_PAGE_IS_PFNZERO
        arg.category_mask = BX_PAGE_IS_PRESENT | BX_PAGE_IS_PFNZERO
        arg.return_mask = BX_PAGE_IS_PRESENT
        r = ioctl(fd, BX_PAGEMAP_SCAN, &arg)
        if r < 0:
            if errno == EINTR:
                continue
            return -errno
        for k in range(r):
            err = _read_range(fd, a, vec[k].start // psz, (vec[k].end - vec[k].start) // psz)
            if err:
                return err
        if arg.walk_end <= start:
            break  # no progress: nothing left the kernel will walk
        start = arg.walk_end
    return 0


def present_pfns(int fd, const uint64_t[:, ::1] ranges, uint64_t zero_pfn, uint64_t hz_lo,
                 uint64_t hz_hi, uint64_t scan_from):
    """(pfns: uint64 ndarray in address order, hidden: int) for the [start, end) byte ranges.

    Ranges of at least ``scan_from`` bytes go through PAGEMAP_SCAN first (0: all of them;
    2**64-1: none): it walks the range once more, which only pays off where it is sparse.

    Raises OSError(errno) when a read or the ioctl fails; ESRCH/ENOENT mean the process left.
    """
    cdef acc_t a
    cdef size_t i, nr = ranges.shape[0]
    cdef uint64_t psz = <uint64_t>sysconf(_SC_PAGESIZE)
    cdef bx_page_region *vec = NULL
    cdef int err = 0
    if ranges.shape[1] != 2:
        raise ValueError("ranges must have shape (n, 2)")
    memset(&a, 0, sizeof(a))
    a.zero_pfn, a.hz_lo, a.hz_hi = zero_pfn, hz_lo, hz_hi
    a.buf = <uint64_t *>malloc(CHUNK * 8)
    cdef bint scan = scan_from != <uint64_t>-1
    if scan:
        vec = <bx_page_region *>malloc(NREGIONS * sizeof(bx_page_region))
    if a.buf == NULL or (scan and vec == NULL):
        free(a.buf)
        free(vec)
        raise MemoryError()
    try:
        with nogil:
            for i in range(nr):
                if scan and ranges[i, 1] - ranges[i, 0] >= scan_from:
                    err = _scan_range(fd, &a, ranges[i, 0], ranges[i, 1], psz, vec)
                else:
                    err = _read_range(fd, &a, ranges[i, 0] // psz,
                                      (ranges[i, 1] - ranges[i, 0]) // psz)
                if err:
                    break
        if err:
            raise OSError(-err, os.strerror(-err))
        out = np.empty(a.n, dtype=np.uint64)
        if a.n:
            _copy(out, a.out, a.n)
        return out, a.hidden
    finally:
        free(a.out)
        free(a.buf)
        free(vec)


cdef void _copy(uint64_t[::1] dst, uint64_t *src, size_t n):
    memcpy(&dst[0], src, n * 8)


def count_family(list parts, const long[::1] gids, long ngroups, uint64_t max_pfn):
    """Count pages per group through a PFN-indexed table (no sort): ``parts[i]`` (uint64 PFNs,
    repeats allowed) belongs to group ``gids[i]``; all parts of one group must be adjacent.

    Returns (rss, shared, total, shared_total): per-group distinct pages and pages some other
    group also maps (int64 arrays), distinct pages overall and those mapped by ≥2 groups.
    """
    cdef long i, g, prev = -1, n = len(parts)
    cdef size_t j
    cdef const uint64_t[::1] p
    cdef uint64_t pfn = 0, total = 0, shared_total = 0
    cdef bint bad = False
    # calloc of this size is fresh zeroed mmap: only the pages the PFNs land in get touched
    cdef unsigned int *seen = <unsigned int *>calloc(max_pfn + 1, sizeof(unsigned int))
    cdef unsigned char *multi = <unsigned char *>calloc(max_pfn + 1, 1)
    rss = np.zeros(ngroups, dtype=np.int64)
    shared = np.zeros(ngroups, dtype=np.int64)
    cdef long long[::1] rv = rss, sv = shared
    if gids.shape[0] != n:
        raise ValueError("parts and gids differ in length")
    if seen == NULL or multi == NULL:
        free(seen)
        free(multi)
        raise MemoryError()
    try:
        for i in range(n):
            g = gids[i]
            if g < prev or g >= ngroups:
                raise ValueError("the parts of each group must be adjacent and gids < ngroups")
            prev = g
        # pass 1: stamp each page with the last group seen (g+1); a new stamp on a stamped page
        # means a second group maps it
        for i in range(n):
            p = parts[i]
            g = gids[i]
            with nogil:
                for j in range(<size_t>p.shape[0]):
                    pfn = p[j]
                    if pfn > max_pfn:
                        bad = True
                        break
                    if seen[pfn] == <unsigned int>(g + 1):
                        continue
                    if seen[pfn] == 0:
                        total += 1
                    elif not multi[pfn]:
                        multi[pfn] = 1
                        shared_total += 1
                    seen[pfn] = g + 1
                    rv[g] += 1
            if bad:
                raise ValueError(f"PFN {pfn} above max_pfn {max_pfn}")
        # pass 2: fresh stamps (ngroups+g+1) dedupe again while counting the shared pages
        for i in range(n):
            p = parts[i]
            g = gids[i]
            with nogil:
                for j in range(<size_t>p.shape[0]):
                    pfn = p[j]
                    if seen[pfn] != <unsigned int>(ngroups + g + 1):
                        seen[pfn] = ngroups + g + 1
                        if multi[pfn]:
                            sv[g] += 1
        return rss, shared, total, shared_total
    finally:
        free(seen)
        free(multi)
