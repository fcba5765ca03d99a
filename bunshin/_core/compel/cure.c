/* Cure: leave the tracee as it was before the first injection: no batch page, the patched
 * bytes and registers back, held signals queued again. */
#include <elf.h>
#include <sys/uio.h>

#include "internal.h"

#ifndef NT_X86_XSTATE
#define NT_X86_XSTATE 0x202
#endif

#define LOG_PREFIX "cure: "

int bx_cure_seized(struct bx_ctl *c)
{
	if (c->cured || !c->attached)
		return 0;
	if (c->dead)
		return bx_fail(c, BX_STEP_CURE, -ESRCH);
	int ret = 0;
	bx_regs_t fin = c->thr[0].regs;
	/* before signals are queued again: a pending one would interrupt the munmap */
	int r = bx_page_release(c);
	if (r)
		ret = bx_fail(c, BX_STEP_CURE, r);
	/* An interrupted system call is left interrupted in the registers put back: every stop of
	 * the injection thread is inside the kernel's signal delivery (the seize's or clone's
	 * event stop, a single step's or the batch's SIGTRAP), and leaving it the kernel itself
	 * finishes the call: restarted, or -EINTR for a handler without SA_RESTART. Doing the
	 * restart here instead would lose a signal that comes before the call is entered again
	 * (a pause() whose wake-up runs its handler first, then sleeps on). */
	if (c->injected && c->nheld)
		bx_requeue_signals(c);
	r = bx_patch_restore(c);
	if (r)
		ret = bx_fail(c, BX_STEP_CURE, r);
	if (c->injected && (r = bx_arch_set_regs(c->thr[0].tid, &fin)))
		ret = bx_fail(c, BX_STEP_CURE, r);
	c->scratch = 0;
	c->prepared = 0; /* a poked instruction is gone now */
	c->injected = 0;
	c->cured = 1;
	bx_log("%d: cured (%d)", c->pid, ret);
	return ret;
}

/* The injection thread's task was given another memory from outside (a transplant: its old
 * mappings unmapped, another process's made in their place): what compel left in the old
 * memory (batch page, patched bytes, scratch, the syscall instruction found) is forgotten
 * without being touched, as it may now be the new memory, and regs (with xstate when given)
 * become what the thread resumes with at cure. What a clone from it needs is learned again. */
int bx_replace_seized(struct bx_ctl *c, const bx_regs_t *regs, const void *xstate, size_t len)
{
	if (c->dead)
		return bx_fail(c, BX_STEP_CURE, -ESRCH);
	if (xstate) {
		struct iovec io = {(void *)xstate, len};
		if (ptrace(PTRACE_SETREGSET, c->thr[0].tid, NT_X86_XSTATE, &io))
			return bx_fail(c, BX_STEP_SETREGS, -errno);
	}
	c->thr[0].regs = *regs;
	c->cur = *regs;
	c->page = 0;
	c->page_owned = 0;
	c->page_fresh = 0;
	c->npatch = 0;
	c->scratch = 0;
	c->prepared = 0;
	c->known = 0;
	c->tid_off = 0;
	c->injected = 1; /* cure sets regs */
	c->cured = 0;
	bx_log("%d: memory and registers replaced", c->pid);
	return 0;
}
