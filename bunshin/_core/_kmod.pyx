# cython: language_level=3
"""The /dev/bunshin ioctls, typed from the module's uapi header (kmod/include/uapi/linux/bunshin.h).

Thin wrappers: each takes an open descriptor of /dev/bunshin, raises OSError with the
kernel's errno, and leaves policy (which backend, what an errno means) to ``bunshin._core.kmod``.
"""

from libc.errno cimport errno
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memset
import os

import numpy as np

cdef extern from "sys/ioctl.h":
    int ioctl(int fd, unsigned long req, ...) nogil

cdef extern from "linux/bunshin.h":
    int BUNSHIN_ABI_VERSION
    int BUNSHIN_NR_GET_VERSION, BUNSHIN_NR_SHARE_STATS, BUNSHIN_NR_REPARENT, BUNSHIN_NR_GROUP_STATS
    int BUNSHIN_NR_FORK, BUNSHIN_FORK_MAX_CHILDREN
    unsigned int BUNSHIN_FORK_IN_PARENT
    int BUNSHIN_NR_RUN, BUNSHIN_RUN_MAX_CALLS, BUNSHIN_RUN_MAX_DATA, BUNSHIN_NR_JOIN_SESSION
    int BUNSHIN_SHARE_STATS_MAX_PIDS
    unsigned int BUNSHIN_REPARENT_TRACED
    unsigned long BUNSHIN_IOC_GET_VERSION, BUNSHIN_IOC_SHARE_STATS, BUNSHIN_IOC_REPARENT
    unsigned long BUNSHIN_IOC_GROUP_STATS, BUNSHIN_IOC_FORK, BUNSHIN_IOC_RUN
    unsigned long BUNSHIN_IOC_JOIN_SESSION
    struct bunshin_version:
        uint32_t abi_version
        uint32_t module_version
        uint64_t features
    struct bunshin_pid_stats:
        int32_t pid
        uint32_t mm_slot
        uint64_t mapped_pages
        uint64_t shared_pages
        uint64_t unique_pages
    struct bunshin_share_stats:
        uint64_t pids_ptr
        uint64_t stats_ptr
        uint32_t npids
        uint32_t stats_size
        uint32_t flags
        uint32_t nmms
        uint64_t shared_pages
        uint64_t total_pages
    struct bunshin_reparent:
        int32_t pid
        int32_t new_parent
        uint32_t flags
        int32_t old_parent
    struct bunshin_group_usage:
        uint64_t mapped_pages
        uint64_t distinct_pages
        uint64_t shared_pages
        uint32_t nmms
    struct bunshin_group_stats:
        uint64_t pids_ptr
        uint64_t groups_ptr
        uint64_t stats_ptr
        uint32_t npids
        uint32_t ngroups
        uint32_t stats_size
        uint32_t flags
        uint64_t shared_pages
        uint64_t total_pages
        uint32_t nmms

    struct bunshin_fork_child:
        int32_t pidns_pid
        int32_t tid
        int32_t parent
        int32_t pid
    struct bunshin_fork:
        int32_t pid
        uint32_t nchildren
        uint64_t children_ptr
        uint32_t child_size
        uint32_t flags
        uint64_t child_tid
        uint32_t done
        uint32_t resumed
    struct bunshin_run_call:
        uint32_t nr
        uint32_t flags
        uint32_t ok_errno
        uint64_t args[6]
        int64_t ret
    struct bunshin_join_session:
        int32_t pid
        int32_t session_of
        int32_t pgrp_of
        int32_t old_sid
        int32_t old_pgid
    struct bunshin_run:
        int32_t pid
        uint32_t ncalls
        uint64_t calls_ptr
        uint64_t data_ptr
        uint32_t data_size
        uint32_t call_size
        uint32_t done
        uint32_t resumed

    unsigned int BUNSHIN_RUN_ARG_RESULT(int i)
    unsigned int BUNSHIN_RUN_ARG_DATA(int i)
    unsigned int BUNSHIN_RUN_OK_ANY

cdef extern from *:
    """
    static const unsigned short bunshin_run_syscalls[] = { BUNSHIN_RUN_SYSCALLS_X86_64 };
    #define BUNSHIN_N_RUN_SYSCALLS (sizeof(bunshin_run_syscalls) / sizeof(bunshin_run_syscalls[0]))
    """
    const unsigned short bunshin_run_syscalls[]
    int BUNSHIN_N_RUN_SYSCALLS

ABI_VERSION = BUNSHIN_ABI_VERSION
NR = {"GET_VERSION": BUNSHIN_NR_GET_VERSION, "SHARE_STATS": BUNSHIN_NR_SHARE_STATS,
      "REPARENT": BUNSHIN_NR_REPARENT, "GROUP_STATS": BUNSHIN_NR_GROUP_STATS,
      "FORK": BUNSHIN_NR_FORK, "RUN": BUNSHIN_NR_RUN, "JOIN_SESSION": BUNSHIN_NR_JOIN_SESSION}
FORK_MAX_CHILDREN = BUNSHIN_FORK_MAX_CHILDREN
FORK_IN_PARENT = BUNSHIN_FORK_IN_PARENT
RUN_MAX_CALLS = BUNSHIN_RUN_MAX_CALLS
RUN_MAX_DATA = BUNSHIN_RUN_MAX_DATA
RUN_SYSCALLS = frozenset(bunshin_run_syscalls[i] for i in range(BUNSHIN_N_RUN_SYSCALLS))
RUN_ARG_RESULT = tuple(BUNSHIN_RUN_ARG_RESULT(i) for i in range(6))
RUN_ARG_DATA = tuple(BUNSHIN_RUN_ARG_DATA(i) for i in range(6))
RUN_OK_ANY = BUNSHIN_RUN_OK_ANY
MAX_PIDS = BUNSHIN_SHARE_STATS_MAX_PIDS
REPARENT_TRACED = BUNSHIN_REPARENT_TRACED


cdef _fail():
    e = errno
    raise OSError(e, os.strerror(e))


def get_version(int fd):
    """GET_VERSION: ``(abi_version, module_version, features)``."""
    cdef bunshin_version v
    memset(&v, 0, sizeof(v))
    _ioctl(fd, BUNSHIN_IOC_GET_VERSION, &v)
    return v.abi_version, v.module_version, v.features


def share_stats(int fd, pids):
    """SHARE_STATS: ``(shared_pages, total_pages, nmms, stats)``; ``stats`` is an (n, 3) uint64
    array of mapped, shared and unique pages per pid."""
    cdef int32_t[::1] p = np.ascontiguousarray(pids, dtype=np.int32)
    cdef Py_ssize_t n = p.shape[0], i
    cdef bunshin_share_stats req
    cdef int r
    if n == 0:
        raise OSError(22, "SHARE_STATS needs at least one pid")
    cdef unsigned char[::1] buf = np.zeros(n * sizeof(bunshin_pid_stats), dtype=np.uint8)
    cdef bunshin_pid_stats *s = <bunshin_pid_stats *>&buf[0]
    memset(&req, 0, sizeof(req))
    req.pids_ptr = <uint64_t>&p[0]
    req.stats_ptr = <uint64_t>s
    req.npids = <uint32_t>n
    req.stats_size = sizeof(bunshin_pid_stats)
    with nogil:
        r = ioctl(fd, BUNSHIN_IOC_SHARE_STATS, &req)
    if r < 0:
        _fail()
    out = np.empty((n, 3), dtype=np.uint64)
    cdef uint64_t[:, ::1] o = out
    for i in range(n):
        o[i, 0] = s[i].mapped_pages
        o[i, 1] = s[i].shared_pages
        o[i, 2] = s[i].unique_pages
    return req.shared_pages, req.total_pages, req.nmms, out


def group_stats(int fd, pids, groups, int ngroups):
    """GROUP_STATS: ``(shared_pages, total_pages, nmms, usage)``; ``usage`` is an
    (ngroups, 3) uint64 array of mapped, distinct and shared pages per group."""
    cdef int32_t[::1] p = np.ascontiguousarray(pids, dtype=np.int32)
    cdef uint32_t[::1] g = np.ascontiguousarray(groups, dtype=np.uint32)
    cdef Py_ssize_t n = p.shape[0], i
    cdef bunshin_group_stats req
    cdef int r
    if n == 0 or g.shape[0] != n or ngroups <= 0:
        raise OSError(22, "GROUP_STATS needs one group per pid and at least one pid")
    cdef unsigned char[::1] buf = np.zeros(ngroups * sizeof(bunshin_group_usage), dtype=np.uint8)
    cdef bunshin_group_usage *s = <bunshin_group_usage *>&buf[0]
    memset(&req, 0, sizeof(req))
    req.pids_ptr = <uint64_t>&p[0]
    req.groups_ptr = <uint64_t>&g[0]
    req.stats_ptr = <uint64_t>s
    req.npids = <uint32_t>n
    req.ngroups = <uint32_t>ngroups
    req.stats_size = sizeof(bunshin_group_usage)
    with nogil:
        r = ioctl(fd, BUNSHIN_IOC_GROUP_STATS, &req)
    if r < 0:
        _fail()
    out = np.empty((ngroups, 3), dtype=np.uint64)
    cdef uint64_t[:, ::1] o = out
    for i in range(ngroups):
        o[i, 0] = s[i].mapped_pages
        o[i, 1] = s[i].distinct_pages
        o[i, 2] = s[i].shared_pages
    return req.shared_pages, req.total_pages, req.nmms, out


cdef _ioctl(int fd, unsigned long cmd, void *req):
    cdef int r
    with nogil:
        r = ioctl(fd, cmd, req)
    if r < 0:
        _fail()


cdef _resumed_error(int e, unsigned int resumed):
    """The OSError of a verb that may have resumed its process (FORK, RUN): ``resumed`` says
    the caller must collect the stop it ends in."""
    exc = OSError(e, os.strerror(e))
    exc.resumed = bool(resumed)
    return exc


def reparent(int fd, int pid, int new_parent, unsigned int flags=0):
    """REPARENT ``pid`` under ``new_parent`` (host pids); returns the old parent's pid."""
    cdef bunshin_reparent req
    memset(&req, 0, sizeof(req))
    req.pid = pid
    req.new_parent = new_parent
    req.flags = flags
    _ioctl(fd, BUNSHIN_IOC_REPARENT, &req)
    return req.old_parent


def fork(int fd, int pid, children, unsigned long long child_tid=0, unsigned int flags=0):
    """FORK: clone host pid ``pid`` (seized by the calling thread, in a ptrace stop) once per
    ``(pidns_pid, tid, parent)`` of ``children``; returns the children's host pids. ``flags``:
    FORK_IN_PARENT or 0. The OSError
    of a failed call carries ``made`` (host pids of the children made anyway) and ``resumed``
    (``pid`` was resumed and stops again: wait for it)."""
    cdef Py_ssize_t n = len(children), i
    if n == 0 or n > BUNSHIN_FORK_MAX_CHILDREN:
        raise ValueError(f"FORK takes 1..{BUNSHIN_FORK_MAX_CHILDREN} children, not {n}")
    cdef unsigned char[::1] buf = np.zeros(n * sizeof(bunshin_fork_child), dtype=np.uint8)
    cdef bunshin_fork_child *k = <bunshin_fork_child *>&buf[0]
    for i, (ns, tid, parent) in enumerate(children):
        k[i].pidns_pid = ns
        k[i].tid = tid
        k[i].parent = parent
    cdef bunshin_fork req
    cdef int r
    memset(&req, 0, sizeof(req))
    req.pid = pid
    req.nchildren = <uint32_t>n
    req.children_ptr = <uint64_t><size_t>k
    req.child_size = sizeof(bunshin_fork_child)
    req.child_tid = child_tid
    req.flags = flags
    with nogil:
        r = ioctl(fd, BUNSHIN_IOC_FORK, &req)
    cdef int e = errno if r < 0 else 0  # before any Python runs
    made = [k[i].pid for i in range(req.done)]
    if e:
        exc = _resumed_error(e, req.resumed)
        exc.made = made
        raise exc
    return made


def run(int fd, int pid, calls, const unsigned char[::1] data=None):
    """RUN: the system calls ``calls`` (``(nr, args, flags, ok_errno)`` each, flags and
    ok_errno as the uapi header says) made by host pid ``pid`` (seized by the calling thread,
    in a ptrace stop) with ``data`` mapped for them; returns the raw results of the calls that
    ran. The OSError of a failed call carries ``resumed`` (``pid`` stops again: wait for it)."""
    cdef Py_ssize_t n = len(calls), i, j
    if n == 0 or n > BUNSHIN_RUN_MAX_CALLS:
        raise ValueError(f"RUN takes 1..{BUNSHIN_RUN_MAX_CALLS} calls, not {n}")
    cdef unsigned char[::1] buf = np.zeros(n * sizeof(bunshin_run_call), dtype=np.uint8)
    cdef bunshin_run_call *c = <bunshin_run_call *>&buf[0]
    for i, (nr, args, flags, ok_errno) in enumerate(calls):
        c[i].nr = nr
        c[i].flags = flags
        c[i].ok_errno = ok_errno
        for j, a in enumerate(args):
            c[i].args[j] = <uint64_t>(a & 0xFFFFFFFFFFFFFFFF)
    cdef bunshin_run req
    cdef int r
    memset(&req, 0, sizeof(req))
    req.pid = pid
    req.ncalls = <uint32_t>n
    req.calls_ptr = <uint64_t><size_t>c
    req.call_size = sizeof(bunshin_run_call)
    if data is not None and data.shape[0]:
        req.data_ptr = <uint64_t><size_t>&data[0]
        req.data_size = <uint32_t>data.shape[0]
    with nogil:
        r = ioctl(fd, BUNSHIN_IOC_RUN, &req)
    if r < 0:
        raise _resumed_error(errno, req.resumed)
    return [c[i].ret for i in range(req.done)]


def join_session(int fd, int pid, int session_of, int pgrp_of):
    """JOIN_SESSION: host pid ``pid`` into ``session_of``'s session and ``pgrp_of``'s process
    group (``pid`` itself: its own); returns its old ``(sid, pgid)``."""
    cdef bunshin_join_session req
    memset(&req, 0, sizeof(req))
    req.pid = pid
    req.session_of = session_of
    req.pgrp_of = pgrp_of
    _ioctl(fd, BUNSHIN_IOC_JOIN_SESSION, &req)
    return req.old_sid, req.old_pgid
