# C declarations of compel/compel.h for Cython.
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from posix.types cimport pid_t, off_t

cdef extern from "<sys/user.h>" nogil:
    struct user_regs_struct:
        unsigned long long r15, r14, r13, r12, rbp, rbx, r11, r10, r9, r8
        unsigned long long rax, rcx, rdx, rsi, rdi, orig_rax, rip, cs, eflags
        unsigned long long rsp, ss, fs_base, gs_base, ds, es, fs, gs

cdef extern from "compel.h" nogil:
    struct bx_ctl:
        pass

    struct bx_rseq:
        uint64_t addr
        uint32_t len
        uint32_t sig
        uint32_t flags

    struct bx_thread_state:
        pid_t tid
        pid_t vtid
        int in_syscall
        user_regs_struct regs
        user_regs_struct resume
        uint64_t sigmask
        uint64_t sigpending
        uint64_t shdpending
        bx_rseq rseq
        uint64_t robust_list
        uint64_t robust_len
        uint64_t tid_addr

    struct bx_clone_req:
        uint64_t flags
        pid_t pidns_pid
        pid_t set_tid
        int quiet_exit
        int owe_robust

    bx_ctl *bx_seize(pid_t tid, int *err)
    bx_ctl *bx_seize_begin(pid_t tid, int *err)
    int bx_seize_finish(bx_ctl *c)
    int bx_stop_all_seized(bx_ctl *c)
    int bx_seize_threads_begin(bx_ctl *c)
    int bx_detach(bx_ctl *c)
    int bx_late(const bx_ctl *c, pid_t *out, int max)
    void bx_free(bx_ctl *c)
    void bx_set_wait_timeout(bx_ctl *c, int64_t ns)
    pid_t bx_overdue(const bx_ctl *c)
    pid_t bx_pid(const bx_ctl *c)
    int bx_take_owed_robust(bx_ctl *c, uint64_t *head, uint64_t *len)
    pid_t bx_tid(const bx_ctl *c)
    pid_t bx_in_parent(const bx_ctl *c)
    int bx_suspends_seccomp()
    int bx_threads(const bx_ctl *c, pid_t *out, int max)
    int bx_last_step(const bx_ctl *c)
    const char *bx_step_name(int step)
    int bx_alive(const bx_ctl *c)
    int bx_prepare_seized(bx_ctl *c)
    int bx_syscall_seized(bx_ctl *c, long nr, const unsigned long *args, long *ret)
    int bx_remote_mmap_seized(bx_ctl *c, unsigned long addr, size_t len, int prot, int flags,
                              int fd, off_t off, unsigned long *out)
    int bx_remote_munmap_seized(bx_ctl *c, unsigned long addr, size_t len)
    int bx_peek(bx_ctl *c, unsigned long addr, void *buf, size_t n)
    int bx_poke(bx_ctl *c, unsigned long addr, const void *buf, size_t n)
    int bx_held_signals(const bx_ctl *c, int *sigs, int max)
    int bx_thread_state_seized(bx_ctl *c, pid_t tid, bx_thread_state *st)
    long bx_xstate_seized(bx_ctl *c, pid_t tid, void *buf, size_t len)
    bx_ctl *bx_clone3_seized(bx_ctl *c, const bx_clone_req *req, int *err)
    int bx_learn_seized(bx_ctl *c)
    int bx_clone_ext_begin(bx_ctl *c, unsigned long *tid_addr)
    int bx_clone_ext_end(bx_ctl *c)
    bx_ctl *bx_clone_ext_adopt(bx_ctl *c, pid_t child, pid_t vtid, int *err)
    int bx_cure_seized(bx_ctl *c)
    int bx_replace_seized(bx_ctl *c, const user_regs_struct *regs, const void *xstate, size_t len)

    struct bx_batch_entry:
        uint64_t ctl
        uint64_t args[6]
        int64_t ret
    size_t bx_batch_code_size()
    int bx_batch_seized(bx_ctl *c, unsigned long code_addr, unsigned long table_addr,
                        bx_batch_entry *tab, size_t n, size_t *ndone)
    int BX_PAGE_SIZE, BX_PAGE_DATA, BX_PAGE_MAX_CALLS
    int bx_batch_page_seized(bx_ctl *c, unsigned long *addr)
    int bx_calls_seized(bx_ctl *c, bx_batch_entry *tab, size_t n, size_t *ndone)

    void bx_set_verbose(int on)

    struct bx_altstack:
        uint64_t sp
        uint64_t size
        int flags

    struct bx_thread_extra:
        bx_altstack altstack
        const void *xstate
        size_t xstate_len

    int bx_thread_syscall_seized(bx_ctl *c, pid_t tid, long nr, const unsigned long *args, long *ret)
    int bx_thread_altstack_seized(bx_ctl *c, pid_t tid, bx_altstack *out)
    int bx_clone_thread_seized(bx_ctl *child, const bx_thread_state *src,
                               const bx_thread_extra *extra, pid_t set_tid, pid_t *out_tid)


cdef class Ctl:
    cdef bx_ctl *c
    cdef readonly int pid
    cdef void _check(self, int err, str step=*) except *
    cdef bx_ctl *_live(self) except NULL
    cdef list _run(self, list calls, unsigned long code_addr, unsigned long table_addr,
                   bint own_page)
