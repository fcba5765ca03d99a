/* Signals that arrive while we run injected code are held back, then queued again with their
 * original siginfo, so the victim sees them after cure exactly as if we had never been there. */
#include <signal.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>

#include "internal.h"

#define LOG_PREFIX "signals: "

int bx_hold_signal(struct bx_ctl *c, pid_t tid, int sig)
{
	/* A standard signal already held is dropped, as the kernel drops one already pending: the
	 * victim has not run since. A template held over many forks would otherwise collect one
	 * SIGCHLD per closed child's init and soon have no room. */
	for (int i = 0; sig < SIGRTMIN && i < c->nheld; i++)
		if (c->held[i].si_signo == sig && c->held_tid[i] == tid) {
			bx_log("%d: signal %d already held", tid, sig);
			return 0;
		}
	if (c->nheld == BX_MAX_HELD)
		return -EAGAIN; /* a signal storm: give up rather than lose one */
	siginfo_t *si = &c->held[c->nheld];
	if (ptrace(PTRACE_GETSIGINFO, tid, 0, si)) {
		memset(si, 0, sizeof *si);
		si->si_signo = sig;
		si->si_code = SI_KERNEL;
	}
	c->held_tid[c->nheld] = tid;
	c->nheld++;
	bx_log("%d: held back signal %d", tid, sig);
	return 0;
}

int bx_held_signals(const struct bx_ctl *c, int *sigs, int max)
{
	for (int i = 0; i < c->nheld && i < max; i++)
		sigs[i] = c->held[i].si_signo;
	return c->nheld;
}

static pid_t vtid_of(const struct bx_ctl *c, pid_t tid)
{
	for (int i = 0; i < c->nthr; i++)
		if (c->thr[i].tid == tid)
			return c->thr[i].vtid;
	return 0;
}

/* rt_tgsigqueueinfo keeps the sender's siginfo and the thread it was delivered to, but the
 * kernel accepts a kill()-style si_code only from the target thread itself: so the injection
 * thread queues its own signals, and the others' whose si_code the kernel lets any thread of
 * the process send (a timer's, sigqueue's). Those it cannot queue are left in c->held for
 * bx_detach to send to their thread with tgkill. */
int bx_requeue_signals(struct bx_ctl *c)
{
	unsigned long scratch;
	int ret = bx_scratch(c, &scratch);
	int left = 0, done = 0;
	for (int i = 0; i < c->nheld; i++) {
		siginfo_t *si = &c->held[i];
		pid_t vtid = vtid_of(c, c->held_tid[i]);
		int own = c->held_tid[i] == c->thr[0].tid;
		int any = si->si_code < 0 && si->si_code != SI_TKILL;
		long rv = -1;
		if (!ret && vtid && (own || any) && !(ret = bx_poke(c, scratch, si, sizeof *si))) {
			unsigned long a[6] = {(unsigned long)c->vpid, (unsigned long)vtid,
					      (unsigned long)si->si_signo, scratch};
			ret = bx_syscall_seized(c, SYS_rt_tgsigqueueinfo, a, &rv);
			if (!ret && rv)
				ret = (int)rv;
		}
		if (!ret && !rv) {
			done++;
			continue;
		}
		c->held[left] = *si;
		c->held_tid[left] = c->held_tid[i];
		left++;
	}
	c->nheld = left;
	bx_log("%d: %d signals queued again, %d left", c->pid, done, c->nheld);
	return ret;
}

/* After detach: what could not be queued from inside goes by tgkill (sender info is lost). */
void bx_send_held(struct bx_ctl *c)
{
	for (int i = 0; i < c->nheld; i++)
		syscall(SYS_tgkill, c->pid, c->held_tid[i] ? c->held_tid[i] : c->thr[0].tid, c->held[i].si_signo);
	c->nheld = 0;
}
