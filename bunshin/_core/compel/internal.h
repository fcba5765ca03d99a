/* The control block and the helpers the compel files share; not part of the public API. */
#ifndef BUNSHIN_COMPEL_INTERNAL_H
#define BUNSHIN_COMPEL_INTERNAL_H

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/ptrace.h>

#include "compel.h"
#include "arch/x86_64.h"

#ifndef PTRACE_O_SUSPEND_SECCOMP
#define PTRACE_O_SUSPEND_SECCOMP (1 << 21)
#endif
#define BX_SEIZE_BASE (PTRACE_O_TRACESYSGOOD | PTRACE_O_TRACECLONE)
/* The options of every seize and PTRACE_SETOPTIONS (which replaces them all): BX_SEIZE_BASE,
 * with PTRACE_O_SUSPEND_SECCOMP once a seize showed this tracer may set it (seize.c). */
#define BX_SEIZE_OPTS bx_seize_opts()
unsigned long bx_seize_opts(void);
#define BX_MAX_HELD 64
#define BX_MAX_PATCH 4
#define BX_SCRATCH_SIZE 512

struct bx_thread {
	pid_t tid;
	pid_t vtid;
	int stopped;
	bx_regs_t regs; /* as stopped, before anything was injected */
};

/* Bytes changed in the tracee that cure puts back. */
struct bx_patch {
	unsigned long addr;
	size_t len;
	int text; /* written with PTRACE_POKEDATA: the mapping may be read-only */
	uint8_t orig[BX_SCRATCH_SIZE];
};

struct bx_ctl {
	pid_t pid, vpid; /* thread group: tracer's pid namespace, its own */
	pid_t in_parent; /* made by bx_clone3_seized: its pid as the cloning process sees it */
	int nthr, cap;
	struct bx_thread *thr; /* thr[0] is the injection thread */
	int step;
	int dead;
	int attached;
	int parent_is_us; /* the tracer is also the real parent of the thread group */
	int prepared;
	int injected; /* thr[0]'s registers were changed: cure must restore them */
	int cured;
	unsigned long sysaddr;
	unsigned long scratch; /* 0 until first used */
	bx_regs_t cur;         /* thr[0]'s registers now */
	int npatch;
	struct bx_patch patch[BX_MAX_PATCH];
	int nheld;
	siginfo_t held[BX_MAX_HELD];
	pid_t held_tid[BX_MAX_HELD]; /* the thread each was delivered to (tracer's pid namespace) */
	pid_t last_child; /* from the latest fork/clone event during injection */
	long tid_off; /* cached tid's offset from the thread pointer, once learned */
	int child_of_clone; /* made by bx_clone3_seized: never stopped by an interrupt */
	/* our batch page (batch.c), 0 if none; a CLONE_VM child borrows its parent's */
	unsigned long page;
	int page_owned;   /* we mapped it here: cure unmaps it */
	int page_fresh;   /* MADV_DONTFORK not applied yet (the first batch in it does) */
	int page_refused; /* W+X refused: calls run one by one */
	/* the injection thread as bx_clone3_seized needs it, read once per seize (clone.c) */
	int known;
	int nslevels;
	unsigned long tid_addr;
	uint64_t robust, robust_len;
	/* a clone's robust list, left for the caller to set (bx_clone_req.owe_robust) */
	uint64_t owed_robust, owed_robust_len;
	int64_t wait_ns;  /* bound of each wait for a report of a thread, 0: none (bx_set_wait_timeout) */
	pid_t overdue;    /* the thread whose report the latest -ETIMEDOUT waited for */
};

extern int bx_verbose;
double bx_now(void); /* seconds, CLOCK_MONOTONIC */
#define bx_log(fmt, ...)                                                                   \
	do {                                                                               \
		if (bx_verbose)                                                            \
			fprintf(stderr, "compel %.6f: " LOG_PREFIX fmt "\n", bx_now(),    \
				##__VA_ARGS__);                                            \
	} while (0)

static inline int bx_fail(struct bx_ctl *c, int step, int err)
{
	c->step = step;
	if (err == -ESRCH || err == -ECHILD)
		c->dead = 1;
	return err;
}

/* seize.c */
struct bx_ctl *bx_ctl_new(pid_t tid, int *err);
int bx_add_thread(struct bx_ctl *c, pid_t tid);
int bx_add_thread_as(struct bx_ctl *c, pid_t tid, pid_t vtid);
int bx_read_nspid(pid_t tid, pid_t *out, int max);
int bx_status_field(pid_t tid, const char *key, char *out, size_t n);
int bx_status_fields(pid_t tid, int nkeys, const char *const keys[], char *const out[], size_t n);
int bx_wait(struct bx_ctl *c, pid_t tid, int *status);
/* bx_wait with a bound of its own: ns > 0, 0 none, BX_WAIT_POLL only a report already there */
int bx_wait_for(struct bx_ctl *c, pid_t tid, int *status, int64_t ns);
#define BX_WAIT_POLL ((int64_t)-1)
#define BX_WAIT_SIGNAL (SIGRTMAX - 2)
/* After a wait of an injection ran past its bound: stop the thread where it is, within the
 * bound, so cure can put it back; resume is how it was let run (PTRACE_SINGLESTEP, ...). */
int bx_stop_overdue(struct bx_ctl *c, pid_t tid, int resume);

/* syscall.c */
int bx_scratch(struct bx_ctl *c, unsigned long *addr);
int bx_patch_save(struct bx_ctl *c, unsigned long addr, size_t len, int text);
int bx_patch_restore(struct bx_ctl *c);

/* signals.c */
int bx_hold_signal(struct bx_ctl *c, pid_t tid, int sig);
/* syscall.c: a fork event stop: notes the child in c->last_child, returns 1 */
int bx_fork_event(struct bx_ctl *c, pid_t tid, int status);
int bx_requeue_signals(struct bx_ctl *c);
void bx_send_held(struct bx_ctl *c);

/* batch.c */
int bx_calls_run(struct bx_ctl *c, struct bx_batch_entry *tab, size_t n, size_t *ndone, int may_map);
int bx_page_release(struct bx_ctl *c);

/* state.c */
int bx_get_robust(pid_t tid, uint64_t *head, uint64_t *len);
unsigned long bx_find_tid_addr(struct bx_ctl *c, const struct bx_thread *t);

#endif
