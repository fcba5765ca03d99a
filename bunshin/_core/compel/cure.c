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
	if (c->injected) {
		/* With held signals queued again, the kernel itself finishes the interrupted
		 * syscall on the way out: restart, or -EINTR if a handler without SA_RESTART
		 * runs. With none, no signal work runs after our syscall-exit stop, so the
		 * restart is done here or the victim would see -ERESTART* in rax. */
		int held = c->nheld;
		if (held)
			bx_requeue_signals(c);
		if (!held || c->nheld)
			bx_arch_apply_restart(&fin);
	}
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
