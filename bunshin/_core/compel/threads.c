/* Recreating a source thread in a forked child: fork() copies only the thread that called it,
 * so every other thread is cloned again from inside the child, then given its source's state.
 *
 * Per-thread kernel state a CLONE_THREAD clone does not copy from its source, and where it
 * comes from here: TLS (CLONE_SETTLS), libc's cached tid and the exit wake-up for
 * pthread_join (CLONE_PARENT_SETTID | CLONE_CHILD_CLEARTID), robust list and rseq (the thread
 * must register them itself: injected), alternate signal stack (injected), signal mask
 * (PTRACE_SETSIGMASK), FPU state (PTRACE_SETREGSET), registers (PTRACE_SETREGS). */
#include <elf.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <linux/futex.h>
#include <linux/sched.h>

#include "internal.h"

#define LOG_PREFIX "threads: "

#ifndef NT_X86_XSTATE
#define NT_X86_XSTATE 0x202
#endif
#define ERESTART_RESTARTBLOCK 516 /* include/linux/errno.h, not exported */

#define THREAD_FLAGS                                                                            \
	(CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD | CLONE_SYSVSEM |     \
	 CLONE_SETTLS)

static int thread_index(const struct bx_ctl *c, pid_t tid)
{
	for (int i = 0; i < c->nthr; i++)
		if (c->thr[i].tid == tid)
			return i;
	return -1;
}

/* One system call in stopped thread i, up to its syscall-exit stop; thread 0 is the injection
 * thread, which has its own machinery (and its registers restored by cure). */
static int run_in(struct bx_ctl *c, int i, long nr, unsigned long a0, unsigned long a1,
		  unsigned long a2, unsigned long a3, long *ret)
{
	unsigned long a[6] = {a0, a1, a2, a3};
	if (i == 0)
		return bx_syscall_seized(c, nr, a, ret);
	pid_t tid = c->thr[i].tid;
	bx_regs_t r;
	int err, st, in_call = 0;
	if ((err = bx_arch_get_regs(tid, &r)))
		return err;
	bx_arch_setup_syscall(&r, c->sysaddr, nr, a);
	if ((err = bx_arch_set_regs(tid, &r)))
		return err;
	if (ptrace(PTRACE_SYSCALL, tid, 0, 0))
		return -errno;
	for (;;) {
		if ((err = bx_wait(c, tid, &st)) == -ETIMEDOUT) { /* stopped for the caller's undo */
			bx_stop_overdue(c, tid, PTRACE_SYSCALL);
			c->overdue = tid;
			return -ETIMEDOUT;
		}
		if (err)
			return err;
		int event = st >> 16, sig = WSTOPSIG(st);
		if (sig == (SIGTRAP | 0x80)) {
			if (in_call) {
				if ((err = bx_arch_get_regs(tid, &r)))
					return err;
				/* interrupted: the kernel restarts it once the held signal is gone */
				if (!bx_arch_is_restart(bx_arch_retval(&r))) {
					*ret = bx_arch_retval(&r);
					bx_log("%d: syscall %ld = %ld", tid, nr, *ret);
					return 0;
				}
			}
			in_call = !in_call;
		} else if (!event && (err = bx_hold_signal(c, tid, sig))) {
			return err;
		}
		if (ptrace(PTRACE_SYSCALL, tid, 0, 0))
			return -errno;
	}
}

int bx_thread_syscall_seized(struct bx_ctl *c, pid_t tid, long nr, const unsigned long args[4],
			     long *ret)
{
	int i = thread_index(c, tid), err;
	if (i < 0 || !c->thr[i].stopped)
		return bx_fail(c, BX_STEP_SYSCALL, -ESRCH);
	if ((err = bx_prepare_seized(c)))
		return err;
	err = run_in(c, i, nr, args[0], args[1], args[2], args[3], ret);
	if (i > 0) {
		/* as in bx_thread_altstack_seized: back to how it was stopped */
		bx_regs_t r = c->thr[i].regs;
		bx_arch_apply_restart(&r);
		int e2 = bx_arch_set_regs(tid, &r);
		err = err ? err : e2;
	}
	return err ? bx_fail(c, BX_STEP_SYSCALL, err) : 0;
}

int bx_thread_altstack_seized(struct bx_ctl *c, pid_t tid, struct bx_altstack *out)
{
	int i = thread_index(c, tid), err;
	unsigned long scratch;
	long rv;
	stack_t ss;
	if (i < 0 || !c->thr[i].stopped)
		return bx_fail(c, BX_STEP_STATE, -ESRCH);
	if ((err = bx_prepare_seized(c)) || (err = bx_scratch(c, &scratch)))
		return err;
	err = run_in(c, i, SYS_sigaltstack, 0, scratch, 0, 0, &rv);
	if (i > 0) {
		/* it now sits at a syscall-exit stop, where the kernel restarts nothing itself */
		bx_regs_t r = c->thr[i].regs;
		bx_arch_apply_restart(&r);
		int e2 = bx_arch_set_regs(tid, &r);
		err = err ? err : e2;
	}
	if (err)
		return bx_fail(c, BX_STEP_STATE, err);
	if (rv)
		return bx_fail(c, BX_STEP_STATE, (int)rv);
	if ((err = bx_peek(c, scratch, &ss, sizeof ss)))
		return err;
	out->sp = (uint64_t)(unsigned long)ss.ss_sp;
	out->size = ss.ss_size;
	out->flags = ss.ss_flags;
	out->pad = 0;
	return 0;
}

/* A restart_syscall in the new thread would run the restart block it inherited from the
 * cloning thread, not the one its source's call left behind: the call returns -EINTR instead,
 * as if a signal handler had run (CRIU restores such threads the same way). bunshin.compel
 * hands most such calls here already made again from the start (its _reissued). */
static void resume_regs(const struct bx_thread_state *src, bx_regs_t *r)
{
	*r = src->resume;
	if (src->in_syscall && bx_arch_retval(&src->regs) == -ERESTART_RESTARTBLOCK) {
		*r = src->regs;
		r->rax = (unsigned long)-EINTR; /* x86_64: belongs behind arch/ once another arch */
		r->orig_rax = (unsigned long)-1;
	}
}

/* Everything after the clone, in the new (stopped) thread i. rseq goes last: registering
 * makes the kernel check the rseq critical section against the ip on the next return to user
 * space, which must then be the thread's own ip, set at the same stop. */
static int fix_up(struct bx_ctl *k, int i, const struct bx_thread_state *src,
		  const struct bx_thread_extra *x, unsigned long scratch)
{
	pid_t tid = k->thr[i].tid;
	long rv = 0;
	int err;
	if (src->robust_list &&
	    ((err = run_in(k, i, SYS_set_robust_list, src->robust_list, src->robust_len, 0, 0,
			   &rv)) || rv))
		return err ? err : (int)rv;
	if (x && !(x->altstack.flags & SS_DISABLE)) {
		stack_t ss = {(void *)(unsigned long)x->altstack.sp, x->altstack.flags & ~SS_ONSTACK,
			      x->altstack.size};
		if ((err = bx_poke(k, scratch, &ss, sizeof ss)))
			return err;
		if ((err = run_in(k, i, SYS_sigaltstack, scratch, 0, 0, 0, &rv)) || rv)
			return err ? err : (int)rv;
	}
	if (x && x->xstate) {
		struct iovec io = {(void *)x->xstate, x->xstate_len};
		if (ptrace(PTRACE_SETREGSET, tid, NT_X86_XSTATE, &io))
			return -errno;
	}
	uint64_t mask = src->sigmask;
	if (ptrace(PTRACE_SETSIGMASK, tid, sizeof mask, &mask))
		return -errno;
	if (src->rseq.addr &&
	    ((err = run_in(k, i, SYS_rseq, src->rseq.addr, src->rseq.len, 0, src->rseq.sig,
			   &rv)) || rv))
		return err ? err : (int)rv;
	bx_regs_t r;
	resume_regs(src, &r);
	if ((err = bx_arch_set_regs(tid, &r)))
		return err;
	k->thr[i].regs = r;
	return 0;
}

/* Undo a half-made thread: it exits without touching the memory it shares with the others
 * (no tid clearing, no robust-list walk), and the cached tid it overwrote is put back. If it
 * cannot be made to exit, the whole child goes: a thread with half its state must not run. */
static void discard(struct bx_ctl *k, int i, const struct bx_thread_state *src)
{
	pid_t tid = k->thr[i].tid;
	long rv;
	int gone = 0;
	if (k->thr[i].stopped) {
		run_in(k, i, SYS_set_tid_address, 0, 0, 0, 0, &rv);
		run_in(k, i, SYS_set_robust_list, 0, sizeof(struct robust_list_head), 0, 0, &rv);
		gone = run_in(k, i, SYS_exit, 0, 0, 0, 0, &rv) == -ESRCH;
	}
	if (!gone) {
		bx_log("%d: thread %d would not exit, killing the child", k->pid, tid);
		syscall(SYS_tgkill, k->pid, tid, SIGKILL);
		k->dead = 1;
	}
	if (src->tid_addr)
		bx_poke(k, src->tid_addr, &src->vtid, sizeof src->vtid);
	k->thr[i] = k->thr[--k->nthr];
}

int bx_clone_thread_seized(struct bx_ctl *k, const struct bx_thread_state *src,
			   const struct bx_thread_extra *extra, pid_t set_tid, pid_t *out_tid)
{
	unsigned long scratch;
	long rv = 0;
	int e, st;
	if ((e = bx_prepare_seized(k)) || (e = bx_scratch(k, &scratch)))
		return e;
	struct {
		struct clone_args args;
		int32_t set_tid;
	} blk;
	memset(&blk, 0, sizeof blk);
	blk.args.flags = THREAD_FLAGS;
	if (src->tid_addr) {
		blk.args.flags |= CLONE_PARENT_SETTID | CLONE_CHILD_CLEARTID;
		blk.args.parent_tid = blk.args.child_tid = src->tid_addr;
	}
	blk.args.tls = bx_arch_tls(&src->regs);
	if (set_tid > 0) {
		/* set_tid[0] is the tid in the innermost namespace: the child's own */
		blk.set_tid = set_tid;
		blk.args.set_tid = scratch + offsetof(__typeof__(blk), set_tid);
		blk.args.set_tid_size = 1;
	}
	if ((e = bx_poke(k, scratch, &blk, sizeof blk)))
		return e;
	k->last_child = 0;
	double t0 = bx_now();
	unsigned long a[6] = {scratch, sizeof blk.args};
	if ((e = bx_syscall_seized(k, SYS_clone3, a, &rv)))
		return e;
	if (rv < 0)
		return bx_fail(k, BX_STEP_CLONE, (int)rv);
	pid_t tid = k->last_child;
	if (tid <= 0) /* TRACECLONE is part of every seize: cannot happen unless reset */
		return bx_fail(k, BX_STEP_CLONE, -ECHILD);
	int i = bx_add_thread(k, tid);
	if (i < 0) {
		syscall(SYS_tgkill, k->pid, tid, SIGKILL);
		k->dead = 1;
		return bx_fail(k, BX_STEP_CHILD, i);
	}
	/* born with a pending trap stop, which it reports before any signal */
	if (!(e = bx_wait(k, tid, &st))) {
		k->thr[i].stopped = 1;
		if (!(st >> 16) && WSTOPSIG(st) != (SIGTRAP | 0x80))
			e = bx_hold_signal(k, tid, WSTOPSIG(st));
	}
	if (!e)
		e = fix_up(k, i, src, extra, scratch);
	if (e) {
		bx_log("%d: thread %d (for %d) failed: %d", k->pid, tid, src->tid, e);
		discard(k, i, src);
		return bx_fail(k, BX_STEP_CHILD, e);
	}
	bx_log("%d: thread %d (tid %ld inside) for %d in %.0f us", k->pid, tid, rv, src->tid,
	       (bx_now() - t0) * 1e6);
	*out_tid = tid;
	return 0;
}
