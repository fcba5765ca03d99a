# cython: language_level=3
"""Binding of the compel C library: one Ctl per seized thread group.

Errors come out as CompelError (an OSError carrying the failed step and the pid); the public
wrapper in bunshin.compel turns them into bunshin.errors.ForkError. Every call that waits for
the tracee releases the GIL.
"""
from libc.stdlib cimport malloc, free
from libc.string cimport memset
from libc.errno cimport EPERM, ETIMEDOUT

import os

_REGS = ("r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx",
         "rdx", "rsi", "rdi", "orig_rax", "rip", "cs", "eflags", "rsp", "ss", "fs_base",
         "gs_base", "ds", "es", "fs", "gs")


class CompelError(OSError):
    """An injection step failed: .errno, .step (e.g. "syscall"), .pid; .tid: with ETIMEDOUT,
    the thread whose report did not come within the wait bound."""

    def __init__(self, err, step, pid, tid=0):
        super().__init__(err, f"{os.strerror(err)} at step {step!r} (pid {pid})")
        self.step = step
        self.pid = pid
        self.tid = tid


def set_verbose(bint on):
    bx_set_verbose(on)


def batch_code_size():
    """Bytes of the blob Ctl.batch copies into the tracee."""
    return bx_batch_code_size()


def suspends_seccomp():
    """1: seizes suspend the victims' seccomp filters; 0: they cannot; -1: none made yet."""
    return bx_suspends_seccomp()


def page_max_calls():
    """How many calls one Ctl.calls() takes."""
    return BX_PAGE_MAX_CALLS


cdef dict _regs(user_regs_struct *r):
    cdef unsigned long long *w = <unsigned long long *>r
    return {name: w[i] for i, name in enumerate(_REGS)}


cdef void _regs_in(dict d, user_regs_struct *r) except *:
    cdef unsigned long long *w = <unsigned long long *>r
    for i, name in enumerate(_REGS):
        w[i] = <unsigned long long>(d[name] & 0xffffffffffffffff)


cdef void _state_in(dict s, bx_thread_state *st) except *:
    """The inverse of Ctl.thread_state(): a state read from one process, for another."""
    memset(st, 0, sizeof(bx_thread_state))
    st.tid = s["tid"]
    st.vtid = s["vtid"]
    st.in_syscall = bool(s["in_syscall"])
    _regs_in(s["regs"], &st.regs)
    _regs_in(s["resume"], &st.resume)
    st.sigmask = s["sigmask"]
    st.sigpending = s["sigpending"]
    st.shdpending = s["shdpending"]
    st.rseq.addr, st.rseq.len, st.rseq.sig, st.rseq.flags = s["rseq"]
    st.robust_list, st.robust_len = s["robust_list"]
    st.tid_addr = s["tid_addr"]


cdef class Ctl:
    def __cinit__(self, int tid=0, bint wait=True):
        cdef int err = 0
        if tid == 0:  # filled in by clone()
            return
        with nogil:
            if wait:
                self.c = bx_seize(tid, &err)
            else:
                self.c = bx_seize_begin(tid, &err)
        if self.c == NULL:
            raise CompelError(-err, "seize", tid)
        self.pid = bx_pid(self.c)

    def seize_finish(self):
        """Wait for the stop a ``wait=False`` seize asked for (after thawing a frozen task)."""
        cdef int err
        cdef bx_ctl *c = self._live()
        with nogil:
            err = bx_seize_finish(c)
        if err == -ETIMEDOUT:  # kept, attached, its stop still asked for
            raise CompelError(ETIMEDOUT, "wait", self.pid, bx_overdue(c))
        if err:
            self.c = NULL  # bx_seize_finish freed it
            raise CompelError(-err, "wait", self.pid)

    def __dealloc__(self):
        if self.c != NULL:
            bx_free(self.c)
            self.c = NULL

    cdef void _check(self, int err, str step=None) except *:
        if self.c == NULL:
            raise CompelError(9, "closed", self.pid)  # EBADF
        if err < 0:
            raise CompelError(-err, step or bx_step_name(bx_last_step(self.c)).decode(),
                              self.pid, bx_overdue(self.c) if err == -ETIMEDOUT else 0)

    cdef bx_ctl *_live(self) except NULL:
        if self.c == NULL:
            raise CompelError(9, "closed", self.pid)
        return self.c

    @property
    def tid(self):
        return bx_tid(self._live())

    @property
    def in_parent(self):
        return bx_in_parent(self._live())

    def take_owed_robust(self):
        cdef uint64_t head = 0, length = 0
        if bx_take_owed_robust(self._live(), &head, &length):
            return (head, length)
        return None

    @property
    def alive(self):
        return self.c != NULL and bx_alive(self.c)

    def set_wait_timeout(self, double seconds):
        """Bound of each wait for a report of a thread (and of the clones made through this
        block later): past it the step fails with ETIMEDOUT. 0: none."""
        bx_set_wait_timeout(self._live(), <int64_t>(seconds * 1e9))

    def late(self):
        """Threads still attached after detach(), their stop asked for and not yet seen."""
        if self.c == NULL:
            return []
        cdef pid_t out[64]
        cdef int n = bx_late(self.c, out, 64)
        return [out[i] for i in range(min(n, 64))]

    def seize_threads(self):
        cdef bx_ctl *c = self._live()
        cdef int err
        with nogil:
            err = bx_seize_threads_begin(c)
        self._check(err)

    def stop_all(self):
        cdef bx_ctl *c = self._live()
        cdef int err
        with nogil:
            err = bx_stop_all_seized(c)
        self._check(err)

    def threads(self):
        cdef bx_ctl *c = self._live()
        cdef int n = bx_threads(c, NULL, 0)
        cdef pid_t *out = <pid_t *>malloc(max(n, 1) * sizeof(pid_t))
        try:
            n = bx_threads(c, out, n)
            return [out[i] for i in range(n)]
        finally:
            free(out)

    def prepare(self):
        cdef bx_ctl *c = self._live()
        cdef int err
        with nogil:
            err = bx_prepare_seized(c)
        self._check(err)

    def syscall(self, long nr, *args):
        if len(args) > 6:
            raise TypeError("a system call takes at most 6 arguments")
        cdef unsigned long a[6]
        cdef long ret = 0
        cdef int err, i
        cdef bx_ctl *c = self._live()
        memset(a, 0, sizeof(a))
        for i, v in enumerate(args):
            a[i] = <unsigned long>(v & 0xffffffffffffffff)
        with nogil:
            err = bx_syscall_seized(c, nr, a, &ret)
        self._check(err)
        return ret

    def batch(self, unsigned long code_addr, unsigned long table_addr, list calls):
        """Run ``calls``, a list of ``(ctl, args)`` (see compel.h: struct bx_batch_entry), in
        one stop; returns the results of those that ran (it stops after the first failure
        not allowed by its ctl)."""
        return self._run(calls, code_addr, table_addr, False)

    def calls(self, list calls):
        """As batch(), in the control block's own page (mapped on first need, unmapped by
        cure), or one call at a time in a process that refuses W+X memory."""
        return self._run(calls, 0, 0, True)

    def page(self):
        """``(addr, size)`` of the free part of the control block's page (mapping it if need
        be), for the data of calls(); None if the process refuses W+X memory."""
        cdef unsigned long addr = 0
        cdef int err
        cdef bx_ctl *c = self._live()
        with nogil:
            err = bx_batch_page_seized(c, &addr)
        if err == -EPERM:
            return None
        self._check(err)
        return (addr + BX_PAGE_DATA, BX_PAGE_SIZE - BX_PAGE_DATA)

    cdef list _run(self, list calls, unsigned long code_addr, unsigned long table_addr,
                   bint own_page):
        cdef size_t n = len(calls), done = 0, i
        cdef int err, j
        cdef bx_ctl *c = self._live()
        cdef bx_batch_entry *tab = <bx_batch_entry *>malloc(max(n, 1) * sizeof(bx_batch_entry))
        if tab == NULL:
            raise MemoryError()
        try:
            memset(tab, 0, max(n, 1) * sizeof(bx_batch_entry))
            for i, (ctl, args) in enumerate(calls):
                if len(args) > 6:
                    raise TypeError("a system call takes at most 6 arguments")
                tab[i].ctl = ctl
                for j, v in enumerate(args):
                    tab[i].args[j] = <uint64_t>(v & 0xffffffffffffffff)
            with nogil:
                if own_page:
                    err = bx_calls_seized(c, tab, n, &done)
                else:
                    err = bx_batch_seized(c, code_addr, table_addr, tab, n, &done)
            self._check(err)
            return [tab[i].ret for i in range(done)]
        finally:
            free(tab)

    def mmap(self, size_t length, int prot, int flags, unsigned long addr=0, int fd=-1,
             long offset=0):
        cdef unsigned long out = 0
        cdef int err
        cdef bx_ctl *c = self._live()
        with nogil:
            err = bx_remote_mmap_seized(c, addr, length, prot, flags, fd, offset, &out)
        self._check(err, "mmap")
        return out

    def munmap(self, unsigned long addr, size_t length):
        cdef int err
        cdef bx_ctl *c = self._live()
        with nogil:
            err = bx_remote_munmap_seized(c, addr, length)
        self._check(err, "munmap")

    def read(self, unsigned long addr, size_t n):
        cdef bx_ctl *c = self._live()
        buf = bytearray(n)
        cdef unsigned char[::1] view = buf
        cdef int err = bx_peek(c, addr, &view[0] if n else NULL, n)
        self._check(err)
        return bytes(buf)

    def write(self, unsigned long addr, const unsigned char[::1] data):
        cdef bx_ctl *c = self._live()
        cdef int err = bx_poke(c, addr, &data[0] if data.shape[0] else NULL, data.shape[0])
        self._check(err)

    def held_signals(self):
        cdef bx_ctl *c = self._live()
        cdef int sigs[64]
        cdef int n = bx_held_signals(c, sigs, 64)
        return [sigs[i] for i in range(min(n, 64))]

    def thread_state(self, pid_t tid):
        cdef bx_thread_state st
        cdef bx_ctl *c = self._live()
        self._check(bx_thread_state_seized(c, tid, &st))
        return {
            "tid": st.tid, "vtid": st.vtid, "in_syscall": bool(st.in_syscall),
            "regs": _regs(&st.regs), "resume": _regs(&st.resume),
            "sigmask": st.sigmask, "sigpending": st.sigpending, "shdpending": st.shdpending,
            "rseq": (st.rseq.addr, st.rseq.len, st.rseq.sig, st.rseq.flags),
            "robust_list": (st.robust_list, st.robust_len), "tid_addr": st.tid_addr,
        }

    def xstate(self, pid_t tid):
        cdef bx_ctl *c = self._live()
        buf = bytearray(1 << 14)
        cdef unsigned char[::1] view = buf
        cdef long n = bx_xstate_seized(c, tid, &view[0], len(buf))
        self._check(<int>n if n < 0 else 0)
        return bytes(buf[:n])

    def clone(self, unsigned long long flags=0, pid_t pidns_pid=0, pid_t set_tid=0,
              bint quiet_exit=False, bint owe_robust=False):
        cdef bx_clone_req req
        cdef int err = 0
        cdef bx_ctl *k
        cdef bx_ctl *c = self._live()
        req.flags = flags
        req.pidns_pid = pidns_pid
        req.set_tid = set_tid
        req.quiet_exit = quiet_exit
        req.owe_robust = owe_robust
        with nogil:
            k = bx_clone3_seized(c, &req, &err)
        self._check(err)
        if k == NULL:
            raise CompelError(10, "clone3", self.pid)  # ECHILD
        cdef Ctl child = Ctl.__new__(Ctl)
        child.c = k
        child.pid = bx_pid(k)
        return child

    def learn(self):
        cdef bx_ctl *c = self._live()
        self._check(bx_learn_seized(c))

    def ext_clone_begin(self):
        """Before a clone made outside compel: returns where each child stores its tid."""
        cdef bx_ctl *c = self._live()
        cdef unsigned long addr = 0
        cdef int err
        with nogil:
            err = bx_clone_ext_begin(c, &addr)
        self._check(err)
        return addr

    def ext_clone_end(self):
        """After it: collect the victim's PTRACE_EVENT_STOP."""
        cdef bx_ctl *c = self._live()
        cdef int err
        with nogil:
            err = bx_clone_ext_end(c)
        self._check(err)

    def ext_clone_adopt(self, pid_t child, pid_t vtid=0):
        """One child of that clone (host pid ``child``, ``vtid`` in its own namespace)."""
        cdef bx_ctl *c = self._live()
        cdef bx_ctl *k
        cdef int err = 0
        with nogil:
            k = bx_clone_ext_adopt(c, child, vtid, &err)
        self._check(err)
        if k == NULL:
            raise CompelError(10, "clone", self.pid)  # ECHILD
        cdef Ctl out = Ctl.__new__(Ctl)
        out.c = k
        out.pid = bx_pid(k)
        return out

    def thread_altstack(self, pid_t tid):
        """(sp, flags, size) of the thread's sigaltstack, read by injection in that thread."""
        cdef bx_altstack alt
        cdef bx_ctl *c = self._live()
        cdef int err
        with nogil:
            err = bx_thread_altstack_seized(c, tid, &alt)
        self._check(err)
        return (alt.sp, alt.flags, alt.size)

    def clone_thread(self, dict state, pid_t set_tid=0, altstack=None, const unsigned char[::1] xstate=None):
        """Recreate a thread described by thread_state() in this (forked) process; returns
        the new thread's tid in the tracer's pid namespace. It stays stopped until detach."""
        cdef bx_thread_state st
        cdef bx_thread_extra extra
        cdef pid_t tid = 0
        cdef int err
        cdef bx_ctl *c = self._live()
        _state_in(state, &st)
        memset(&extra, 0, sizeof(extra))
        extra.altstack.flags = 2  # SS_DISABLE: unknown is none
        if altstack is not None:
            extra.altstack.sp, extra.altstack.flags, extra.altstack.size = altstack
        if xstate is not None and xstate.shape[0]:
            extra.xstate = &xstate[0]
            extra.xstate_len = xstate.shape[0]
        with nogil:
            err = bx_clone_thread_seized(c, &st, &extra, set_tid, &tid)
        self._check(err)
        return tid

    def thread_syscall(self, pid_t tid, long nr, *args):
        """System call ``nr`` (up to four arguments) in thread ``tid``; its raw result."""
        cdef unsigned long a[4]
        cdef long ret = 0
        cdef int i
        cdef bx_ctl *c = self._live()
        if len(args) > 4:
            raise ValueError("at most 4 arguments")
        memset(a, 0, sizeof(a))
        for i, v in enumerate(args):
            a[i] = <unsigned long>(v & 0xffffffffffffffff)
        self._check(bx_thread_syscall_seized(c, tid, nr, a, &ret))
        return ret

    def replace(self, dict regs, const unsigned char[::1] xstate=None):
        """The task's memory was replaced from outside: forget compel's bytes in the old one,
        resume with ``regs`` (and ``xstate``, the FPU state, when given)."""
        cdef bx_ctl *c = self._live()
        cdef user_regs_struct r
        _regs_in(regs, &r)
        self._check(bx_replace_seized(c, &r, &xstate[0] if xstate is not None else NULL,
                                      len(xstate) if xstate is not None else 0))

    def cure(self):
        cdef bx_ctl *c = self._live()
        cdef int err
        with nogil:
            err = bx_cure_seized(c)
        self._check(err)

    def detach(self):
        """Cure if needed, let every thread go, free the control block. Idempotent. A thread
        whose stop is owed and has not come (late()) stays attached, and so does the block:
        detach again once it has."""
        cdef int err = 0, late = 0
        if self.c == NULL:
            return
        with nogil:
            err = bx_detach(self.c)
            late = bx_late(self.c, NULL, 0)
            if not late:
                bx_free(self.c)
        if not late:
            self.c = NULL
        if err < 0:
            raise CompelError(-err, "detach", self.pid)
