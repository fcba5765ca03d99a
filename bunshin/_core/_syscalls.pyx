# cython: language_level=3
"""Syscalls Python's os module does not offer, and the init protocol's numbers.

Kept minimal: everything that can be done from Python is done in Python.
"""

from libc.stdlib cimport malloc, free
from libc.errno cimport errno
from libc.stdint cimport uint32_t
import os

cdef extern from "clone_exec.h":
    int bx_clone_exec(unsigned long long flags, const char *path, char **argv, char **envp,
                      const int *stdio, int ctl, int *pidfd) nogil
    long bx_openat2(int dirfd, const char *path, unsigned long long flags,
                    unsigned long long mode, unsigned long long resolve) nogil

cdef extern from "init/proto.h":
    int BX_PROTO_VERSION, BX_MAX_INLINE, BX_MAX_FDS, BX_CTL_FD
    int BX_REQ_SPAWN, BX_REQ_KILL, BX_REQ_PING, BX_REQ_SHUTDOWN, BX_REQ_REROOT
    int BX_REP_READY, BX_REP_SPAWNED, BX_REP_EXITED, BX_REP_ACK, BX_REP_FATAL
    int BX_F_PAYLOAD_FD, BX_SPAWN_SETSID, BX_SPAWN_CTTY, BX_SPAWN_TRACK, BX_SPAWN_USER, BX_MAX_GROUPS
    int BX_STEP_NONE, BX_STEP_FORK, BX_STEP_CHDIR, BX_STEP_EXEC, BX_STEP_FDS, BX_STEP_CTTY, BX_STEP_USER
    int BX_KILL_PID, BX_KILL_PGRP, BX_KILL_ALL
    struct bx_msg:
        pass
    struct bx_spawn:
        pass
    struct bx_user:
        pass

PROTO = {
    "VERSION": BX_PROTO_VERSION, "MAX_INLINE": BX_MAX_INLINE, "MAX_FDS": BX_MAX_FDS,
    "CTL_FD": BX_CTL_FD,
    "REQ_SPAWN": BX_REQ_SPAWN, "REQ_KILL": BX_REQ_KILL, "REQ_PING": BX_REQ_PING,
    "REQ_SHUTDOWN": BX_REQ_SHUTDOWN, "REQ_REROOT": BX_REQ_REROOT,
    "REP_READY": BX_REP_READY, "REP_SPAWNED": BX_REP_SPAWNED, "REP_EXITED": BX_REP_EXITED,
    "REP_ACK": BX_REP_ACK, "REP_FATAL": BX_REP_FATAL,
    "F_PAYLOAD_FD": BX_F_PAYLOAD_FD, "SPAWN_SETSID": BX_SPAWN_SETSID,
    "SPAWN_CTTY": BX_SPAWN_CTTY, "SPAWN_TRACK": BX_SPAWN_TRACK,
    "SPAWN_USER": BX_SPAWN_USER, "MAX_GROUPS": BX_MAX_GROUPS,
    "STEP_NONE": BX_STEP_NONE, "STEP_FORK": BX_STEP_FORK, "STEP_CHDIR": BX_STEP_CHDIR,
    "STEP_EXEC": BX_STEP_EXEC, "STEP_FDS": BX_STEP_FDS, "STEP_CTTY": BX_STEP_CTTY,
    "STEP_USER": BX_STEP_USER,
    "KILL_PID": BX_KILL_PID, "KILL_PGRP": BX_KILL_PGRP, "KILL_ALL": BX_KILL_ALL,
    "SIZEOF_MSG": sizeof(bx_msg), "SIZEOF_SPAWN": sizeof(bx_spawn), "SIZEOF_USER": sizeof(bx_user),
}

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10


cdef char **_cstrings(list items, list keep) except NULL:
    cdef char **arr = <char **>malloc((len(items) + 1) * sizeof(char *))
    if arr == NULL:
        raise MemoryError()
    for i, s in enumerate(items):
        b = os.fsencode(s)
        keep.append(b)
        arr[i] = <char *>b
    arr[len(items)] = NULL
    return arr


def clone_exec(unsigned long long flags, path, list argv, list envp, stdio, int ctl):
    """Run ``path`` as the first process of new namespaces ``flags`` (CLONE_NEW* bits).

    The child gets fds 0-2 from ``stdio`` and fd 3 = ``ctl``; nothing else is inherited.
    Returns ``(pid, pidfd)``.
    """
    cdef list keep = []
    cdef bytes bpath = os.fsencode(path)
    cdef char **cargv = _cstrings(argv, keep)
    cdef char **cenvp = NULL
    cdef int cstdio[3]
    cdef int pidfd = -1
    cdef int pid
    cdef const char *cpath = bpath
    try:
        cenvp = _cstrings(envp, keep)
        for i in range(3):
            cstdio[i] = stdio[i]
        with nogil:
            pid = bx_clone_exec(flags, cpath, cargv, cenvp, cstdio, ctl, &pidfd)
        if pid < 0:
            raise OSError(errno, os.strerror(errno))
        return pid, pidfd
    finally:
        free(cargv)
        free(cenvp)


def openat2(int dirfd, path, unsigned long long flags, unsigned long long mode=0,
            unsigned long long resolve=0):
    """openat2(2): open ``path`` relative to ``dirfd`` with RESOLVE_* restrictions."""
    cdef bytes bpath = os.fsencode(path)
    cdef const char *cpath = bpath
    cdef long fd
    with nogil:
        fd = bx_openat2(dirfd, cpath, flags, mode, resolve)
    if fd < 0:
        raise OSError(errno, os.strerror(errno), os.fsdecode(bpath))
    return fd


cdef extern from "mount_api.h":
    int bx_overlay_mount_fd(const char **lowers, int nlowers, const char *upper, const char *work,
                            char *msg, size_t msglen) nogil

cdef extern from "unistd.h":
    long syscall(long nr, ...) nogil


def overlay_mount_fd(list lowers, upper, work):
    """A detached overlay mount (``lowers`` topmost first) as an fd, for move_mount(2)."""
    cdef list keep = [os.fsencode(p) for p in lowers]
    cdef const char **arr = <const char **>malloc(max(len(keep), 1) * sizeof(char *))
    cdef bytes bu = os.fsencode(upper), bw = os.fsencode(work)
    cdef const char *cu = bu
    cdef const char *cw = bw
    cdef int n = len(keep), fd
    cdef char msg[1024]
    msg[0] = 0
    if arr == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            arr[i] = <const char *>keep[i]
        with nogil:
            fd = bx_overlay_mount_fd(arr, n, cu, cw, msg, sizeof(msg))
        if fd < 0:
            why = msg.decode(errors="replace")
            raise OSError(-fd, f"overlay mount: {os.strerror(-fd)}" + (f" ({why})" if why else ""))
        return fd
    finally:
        free(arr)


KCMP_FILE = 0
KCMP_VM = 1


def kcmp(int pid1, int pid2, int typ, unsigned long idx1, unsigned long idx2):
    """kcmp(2): 0 when both refer to the same kernel object (e.g. one open file description)."""
    cdef long r
    with nogil:
        r = syscall(312, pid1, pid2, typ, idx1, idx2)
    if r < 0:
        raise OSError(errno, os.strerror(errno))
    return r
