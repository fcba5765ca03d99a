/* compel.h: inject system calls into a live process, the way the fork engine needs it.
 *
 * The lifecycle, in order:
 *   bx_seize()            attach to one thread and stop it; it becomes the injection thread
 *   bx_stop_all_seized()  attach to and stop every other thread of its thread group
 *   bx_prepare_seized()   find a `syscall` instruction the injection thread can execute
 *   bx_syscall_seized()   run system calls in the injection thread (bx_clone3_seized, bx_remote_*)
 *   bx_batch_seized()     run a list of them in one stop (batch.c); bx_calls_seized in a page
 *                         of the control block's own, which cure unmaps
 *   bx_cure_seized()      re-queue held-back signals, restore every register and patched byte
 *   bx_detach()           let every thread run again, untraced
 *   bx_free()             release the control block (cures and detaches first if still needed)
 *
 * Functions that return int give 0 or -errno. On failure the control block remembers which step
 * failed (bx_last_step). Each wait for a thread's report is bounded by bx_set_wait_timeout:
 * past it the step fails with -ETIMEDOUT (bx_overdue names the thread) and the thread is
 * stopped where it is (an injected call: cure puts it back) or, not stoppable, left late.
 * The tracer must make every call for one control block from the thread that called
 * bx_seize: ptrace attaches to a thread, not to a process.
 */
#ifndef BUNSHIN_COMPEL_H
#define BUNSHIN_COMPEL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/user.h>

struct bx_ctl; /* opaque: one seized thread group */

enum bx_step {
	BX_STEP_NONE,
	BX_STEP_SEIZE,
	BX_STEP_INTERRUPT,
	BX_STEP_WAIT,
	BX_STEP_STOP_ALL,
	BX_STEP_GETREGS,
	BX_STEP_PREPARE,
	BX_STEP_SETREGS,
	BX_STEP_SYSCALL,
	BX_STEP_PEEK,
	BX_STEP_POKE,
	BX_STEP_STATE,
	BX_STEP_PIDNS,
	BX_STEP_CLONE,
	BX_STEP_CHILD,
	BX_STEP_SIGNALS,
	BX_STEP_CURE,
	BX_STEP_DETACH,
	BX_STEP_BATCH,
};

struct bx_rseq {
	uint64_t addr;
	uint32_t len;
	uint32_t sig;
	uint32_t flags;
};

/* What the fork engine needs to recreate a thread in a child. */
struct bx_thread_state {
	pid_t tid;       /* in the tracer's pid namespace */
	pid_t vtid;      /* in the thread's own pid namespace */
	int in_syscall;  /* stopped inside a system call that will be restarted */
	struct user_regs_struct regs;   /* as stopped; fs_base and gs_base included */
	struct user_regs_struct resume; /* what it runs with if resumed alone: restart applied */
	uint64_t sigmask;
	uint64_t sigpending;   /* thread-directed, from /proc */
	uint64_t shdpending;   /* process-directed, from /proc */
	struct bx_rseq rseq;   /* addr 0: not registered */
	uint64_t robust_list;  /* head registered with set_robust_list, 0 if none */
	uint64_t robust_len;
	uint64_t tid_addr;     /* libc's cached tid in the thread's TCB, 0 if not found */
};

/* A clone of the injection thread's process (a fork: new process, memory copy-on-write). */
struct bx_clone_req {
	uint64_t flags;    /* extra clone3 flags, e.g. CLONE_PARENT; exit signal is SIGCHLD */
	pid_t pidns_pid;   /* >0: create the child in the pid namespace whose init (or any member)
			      has this pid in the tracer's namespace */
	pid_t set_tid;     /* >0: the pid the child gets in its own pid namespace */
	int quiet_exit;    /* 1: exit_signal 0, the child's death signals nobody (reap with __WALL) */
	int owe_robust;    /* 1: leave the child's robust list (fork drops it) for the caller to
			      set in a batch of its own (bx_take_owed_robust): one stop less */
};

/* seize.c */
struct bx_ctl *bx_seize(pid_t tid, int *err);
/* bx_seize in two halves, for frozen tasks: begin on every task, thaw, then finish each. */
struct bx_ctl *bx_seize_begin(pid_t tid, int *err);
int bx_seize_finish(struct bx_ctl *c);
int bx_stop_all_seized(struct bx_ctl *c);
/* Attach to every other thread and ask each for a stop, without waiting (a frozen task stops
 * once thawed); bx_stop_all_seized then waits for them. */
int bx_seize_threads_begin(struct bx_ctl *c);
/* Lets go of every stopped thread. A thread whose stop is still owed (a seize or stop_all
 * past its bound) is collected if it has stopped since, else stays attached, its stop still
 * asked for (the block with it: bx_late); call bx_detach again later to let it go. */
int bx_detach(struct bx_ctl *c);
int bx_late(const struct bx_ctl *c, pid_t *out, int max); /* late threads; returns the count */
void bx_free(struct bx_ctl *c);
/* Bound of each wait for a report of a thread of c (and of the clones made through it), in
 * nanoseconds; 0: none. Uses a per-thread POSIX timer signalling BX_WAIT_SIGNAL (SIGRTMAX - 2) to the
 * waiting thread, whose handler (installed once, without SA_RESTART) does nothing. */
void bx_set_wait_timeout(struct bx_ctl *c, int64_t ns);
pid_t bx_overdue(const struct bx_ctl *c); /* the thread of the latest -ETIMEDOUT, 0 if none */
pid_t bx_pid(const struct bx_ctl *c);   /* thread group id, tracer's namespace */
/* The robust list a clone made with owe_robust must still be given (set_robust_list) before
 * it runs: 1 and the head and length, once; 0 if none is owed. */
int bx_take_owed_robust(struct bx_ctl *c, uint64_t *head, uint64_t *len);
pid_t bx_tid(const struct bx_ctl *c);   /* injection thread, tracer's namespace */
/* A clone's pid in the active pid namespace of the process that made it (clone3's result
 * there: whom it can wait4 for); 0 for a task compel did not clone. */
pid_t bx_in_parent(const struct bx_ctl *c);
/* Whether seizes suspend the victims' seccomp filters: 1 yes, 0 no, -1 no seize made yet. */
int bx_suspends_seccomp(void);
int bx_threads(const struct bx_ctl *c, pid_t *out, int max); /* returns the count */
int bx_last_step(const struct bx_ctl *c);
const char *bx_step_name(int step);
void bx_set_verbose(int on); /* log each step to stderr */
int bx_alive(const struct bx_ctl *c);

/* syscall.c */
int bx_prepare_seized(struct bx_ctl *c);
int bx_syscall_seized(struct bx_ctl *c, long nr, const unsigned long args[6], long *ret);
int bx_remote_mmap_seized(struct bx_ctl *c, unsigned long addr, size_t len, int prot, int flags,
			  int fd, off_t off, unsigned long *out);
int bx_remote_munmap_seized(struct bx_ctl *c, unsigned long addr, size_t len);
int bx_peek(struct bx_ctl *c, unsigned long addr, void *buf, size_t n);
int bx_poke(struct bx_ctl *c, unsigned long addr, const void *buf, size_t n);

/* batch.c: many system calls in one stop. A small position-independent program (the blob) is
 * copied into the tracee and walks a table of entries, so the tracer pays one resume and one
 * stop for the lot instead of two stops per call. */
struct bx_batch_entry {
	uint64_t ctl;     /* syscall number | BX_BATCH_REF(i)... | BX_BATCH_OK_ERR or _OK_ERRNO(e) */
	uint64_t args[6]; /* args[i] with BX_BATCH_REF(i): the index of an earlier entry */
	int64_t ret;      /* out */
};
#define BX_BATCH_END (~0ULL)              /* what ends the table in the tracee */
#define BX_BATCH_REF(i) (1ULL << (16 + (i))) /* args[i] := ret of entry args[i] */
#define BX_BATCH_OK_ERR (1ULL << 24)      /* an error here does not stop the batch */
#define BX_BATCH_OK_ERRNO(e) ((uint64_t)(e) << 32) /* nor does this one error (1..4095) */

size_t bx_batch_code_size(void);
/* Runs tab[0..n) in the injection thread: the blob is copied to code_addr (bx_batch_code_size()
 * bytes, executable), the table to table_addr ((n + 1) * 64 bytes, writable), both in the
 * tracee. Stops after the first entry that fails without BX_BATCH_OK_ERR. Fills tab[i].ret for
 * the *ndone entries that ran. Returns 0 (whatever the entries returned) or -errno; the
 * registers are left for cure as bx_syscall_seized leaves them. */
int bx_batch_seized(struct bx_ctl *c, unsigned long code_addr, unsigned long table_addr,
		    struct bx_batch_entry *tab, size_t n, size_t *ndone);

/* The control block's own batch page: one page, read/write/execute, mapped in the tracee on
 * first need, kept out of the tracee's forks (MADV_DONTFORK; a CLONE_VM child shares it, and
 * only borrows it), reused for every batch while seized, unmapped by cure. The blob and table
 * take its first half; the rest is free for the caller's data (the arguments of its calls). */
#define BX_PAGE_SIZE 4096
#define BX_PAGE_TABLE 256  /* the table after the blob */
#define BX_PAGE_DATA 2048  /* the caller's, to the end of the page */
#define BX_PAGE_MAX_CALLS ((BX_PAGE_DATA - BX_PAGE_TABLE) / 64 - 2) /* an end, a madvise */
/* The page's address (mapping it if need be); -EPERM if the tracee refuses W+X memory. */
int bx_batch_page_seized(struct bx_ctl *c, unsigned long *addr);
/* bx_batch_seized in that page, or one call at a time (same results) where it cannot be had. */
int bx_calls_seized(struct bx_ctl *c, struct bx_batch_entry *tab, size_t n, size_t *ndone);

/* signals.c */
int bx_held_signals(const struct bx_ctl *c, int *sigs, int max); /* returns the count */

/* state.c */
int bx_thread_state_seized(struct bx_ctl *c, pid_t tid, struct bx_thread_state *st);
/* The thread's extended FPU state (NT_X86_XSTATE); returns its size or -errno. */
long bx_xstate_seized(struct bx_ctl *c, pid_t tid, void *buf, size_t len);

/* clone.c: the child comes back stopped, attached and prepared, as a control block of its own. */
struct bx_ctl *bx_clone3_seized(struct bx_ctl *c, const struct bx_clone_req *req, int *err);
/* Read now what a clone from this task needs of it (its pid depth, cached tid address,
 * robust list: ~30 us of /proc and ptrace reads), so that its first clone does not. */
int bx_learn_seized(struct bx_ctl *c);
/* Around a clone made by someone else (the kernel module's FORK resumes the victim, which
 * clones itself and stops again): begin prepares the victim and says where each child should
 * store its tid (CLONE_CHILD_SETTID, 0: nowhere); end collects the victim's PTRACE_EVENT_STOP;
 * adopt takes one child, stopped in its first PTRACE_EVENT_STOP, as a control block. */
int bx_clone_ext_begin(struct bx_ctl *c, unsigned long *tid_addr);
int bx_clone_ext_end(struct bx_ctl *c);
struct bx_ctl *bx_clone_ext_adopt(struct bx_ctl *c, pid_t child, pid_t vtid, int *err);

/* cure.c */
int bx_cure_seized(struct bx_ctl *c);
/* The task's memory was replaced from outside (a transplant): forget what compel put in the old
 * one without touching it, set the FPU state (xstate: NULL keeps it) and make regs what the
 * injection thread resumes with at cure; the syscall instruction is looked for again. */
int bx_replace_seized(struct bx_ctl *c, const struct user_regs_struct *regs, const void *xstate,
		      size_t len);

/* threads.c: fork copies only the calling thread; these recreate the others in the child. */
struct bx_altstack {
	uint64_t sp;
	uint64_t size;
	int32_t flags; /* SS_DISABLE when the thread has none */
	int32_t pad;
};

/* What bx_thread_state leaves out, because reading it costs an injection or a large buffer. */
struct bx_thread_extra {
	struct bx_altstack altstack; /* from bx_thread_altstack_seized */
	const void *xstate;          /* from bx_xstate_seized; NULL: the cloning thread's stays */
	size_t xstate_len;
};

/* The alternate signal stack of thread tid (seized and stopped), read by running sigaltstack
 * in that very thread; its registers are put back as cure would. */
int bx_thread_altstack_seized(struct bx_ctl *c, pid_t tid, struct bx_altstack *out);
/* Run system call nr (up to four arguments) in thread tid (seized and stopped) of c; its
 * registers are put back as cure would. For what is a thread's own (its credentials). */
int bx_thread_syscall_seized(struct bx_ctl *c, pid_t tid, long nr, const unsigned long args[4],
			     long *ret);
/* Clone a thread into the child's thread group (made by the child's injection thread): same
 * TLS, cached tid address (set and cleared by the kernel), robust list, rseq, signal mask,
 * registers as src resumes, and what extra gives (may be NULL). set_tid > 0: its tid in the
 * child's own pid namespace. The thread stays seized and stopped; bx_detach(child) lets it run
 * with the rest. On failure no thread is left behind. */
int bx_clone_thread_seized(struct bx_ctl *child, const struct bx_thread_state *src,
			   const struct bx_thread_extra *extra, pid_t set_tid, pid_t *out_tid);

#endif
