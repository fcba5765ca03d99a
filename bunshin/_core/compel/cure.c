/* Cure: leave the tracee as it was before the first injection: no batch page, the patched
 * bytes and registers back, held signals queued again. */
#include "internal.h"

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
