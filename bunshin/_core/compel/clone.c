/* Fork the seized process from inside: an injected clone3, optionally into another pid
 * namespace with a chosen pid. The child arrives attached (PTRACE_O_TRACEFORK) and stopped. */
#include <sched.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <linux/sched.h>

#include "internal.h"

#define LOG_PREFIX "clone: "

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

static long inject(struct bx_ctl *c, long nr, unsigned long a0, unsigned long a1,
		   unsigned long a2, int *err)
{
	unsigned long a[6] = {a0, a1, a2};
	long rv = -1;
	*err = bx_syscall_seized(c, nr, a, &rv);
	return rv;
}

/* setns() accepts only a pid namespace below the caller's own, so its members are visible
 * from the victim's namespace: the pid to open is the NSpid entry at the victim's depth. */
static int victim_view(struct bx_ctl *c, pid_t host_pid, pid_t *vpid)
{
	pid_t mine[32], theirs[32];
	int nm = bx_read_nspid(c->pid, mine, 32);
	int nt = bx_read_nspid(host_pid, theirs, 32);
	if (nm < 0)
		return nm;
	if (nt < 0)
		return nt;
	if (nt < nm)
		return -EINVAL;
	*vpid = theirs[nm - 1];
	return 0;
}

/* The child copy of everything the parent's control block knows, minus what it must not do:
 * it was never interrupted and has no held signals. */
static struct bx_ctl *adopt_child(struct bx_ctl *c, pid_t child, int *err)
{
	int st;
	if ((*err = bx_wait(c, child, &st)))
		return NULL;
	struct bx_ctl *k = calloc(1, sizeof *k);
	if (!k) {
		*err = -ENOMEM;
		return NULL;
	}
	k->pid = child;
	if ((*err = bx_add_thread(k, child)) < 0) {
		free(k);
		return NULL;
	}
	k->vpid = k->thr[0].vtid;
	k->attached = 1;
	k->prepared = 1;
	k->injected = 1; /* its registers are those of the injected clone3: cure restores them */
	k->child_of_clone = 1;
	k->sysaddr = c->sysaddr;
	k->thr[0].stopped = 1;
	k->thr[0].regs = c->thr[0].regs;
	bx_arch_apply_restart(&k->thr[0].regs);
	k->cur = k->thr[0].regs;
	memcpy(k->patch, c->patch, sizeof c->patch);
	k->npatch = c->npatch;
	k->scratch = c->scratch;
	*err = 0;
	return k;
}

struct bx_ctl *bx_clone3_seized(struct bx_ctl *c, const struct bx_clone_req *req, int *err)
{
	int e = 0, fd_target = -1, fd_home = -1;
	long rv;
	pid_t ns_vpid = 0, child = 0;
	struct bx_ctl *k = NULL;
	unsigned long scratch;

	if ((e = bx_prepare_seized(c)) || (e = bx_scratch(c, &scratch)))
		goto out;
	unsigned long tid_addr = bx_find_tid_addr(c, &c->thr[0]);
	if (req->pidns_pid > 0) {
		c->step = BX_STEP_PIDNS;
		if ((e = victim_view(c, req->pidns_pid, &ns_vpid)))
			goto out;
		rv = inject(c, SYS_pidfd_open, ns_vpid, 0, 0, &e);
		if (e || (e = rv < 0 ? (int)rv : 0))
			goto out;
		fd_target = (int)rv;
		rv = inject(c, SYS_pidfd_open, c->vpid, 0, 0, &e);
		if (e || (e = rv < 0 ? (int)rv : 0))
			goto out;
		fd_home = (int)rv;
		rv = inject(c, SYS_setns, fd_target, CLONE_NEWPID, 0, &e);
		if (e || (e = (int)rv))
			goto out;
	}

	struct {
		struct clone_args args;
		int32_t set_tid;
	} blk;
	memset(&blk, 0, sizeof blk);
	/* With CLONE_VM the child's "TCB" is the victim's own: writing its tid there would
	 * corrupt the victim's cached tid. */
	if (req->flags & CLONE_VM)
		tid_addr = 0;
	blk.args.flags = req->flags | (tid_addr ? CLONE_CHILD_SETTID : 0);
	blk.args.child_tid = tid_addr;
	blk.args.exit_signal = req->quiet_exit ? 0 : SIGCHLD;
	if (req->set_tid > 0) {
		blk.set_tid = req->set_tid;
		blk.args.set_tid = scratch + offsetof(__typeof__(blk), set_tid);
		blk.args.set_tid_size = 1;
	}
	if ((e = bx_poke(c, scratch, &blk, sizeof blk)))
		goto home;
	/* fork events only now: the victim's own forks must never be attached to us */
	c->step = BX_STEP_CLONE;
	if (ptrace(PTRACE_SETOPTIONS, c->thr[0].tid, 0, BX_SEIZE_OPTS | PTRACE_O_TRACEFORK)) {
		e = -errno;
		goto home;
	}
	c->last_child = 0;
	bx_log("%d: clone3 begins", c->pid);
	rv = inject(c, SYS_clone3, scratch, sizeof blk.args, 0, &e);
	ptrace(PTRACE_SETOPTIONS, c->thr[0].tid, 0, BX_SEIZE_OPTS);
	if (!e && rv < 0)
		e = (int)rv;
	if (!e && !(child = c->last_child))
		e = -ECHILD;
	bx_log("%d: clone3 = %ld, child %d", c->pid, rv, child);
home:
	if (fd_target >= 0) {
		int e2;
		c->step = BX_STEP_PIDNS;
		rv = inject(c, SYS_setns, fd_home, CLONE_NEWPID, 0, &e2);
		if (!e && (e2 || rv))
			e = e2 ? e2 : (int)rv;
	}
out:
	if (fd_target >= 0)
		inject(c, SYS_close, fd_target, 0, 0, &(int){0});
	if (fd_home >= 0)
		inject(c, SYS_close, fd_home, 0, 0, &(int){0});
	if (child > 0) {
		int e2 = 0;
		k = adopt_child(c, child, &e2);
		bx_log("%d: child %d stopped", c->pid, child);
		if (k) {
			/* the child inherited our fds; fork() also dropped its robust list */
			if (fd_target >= 0)
				inject(k, SYS_close, fd_target, 0, 0, &e2);
			if (!e2 && fd_home >= 0)
				inject(k, SYS_close, fd_home, 0, 0, &e2);
			struct bx_thread_state st;
			if (!e2 && !bx_thread_state_seized(c, c->thr[0].tid, &st) && st.robust_list)
				inject(k, SYS_set_robust_list, st.robust_list, st.robust_len, 0, &e2);
		}
		if (e2 && !e) {
			c->step = BX_STEP_CHILD;
			e = e2;
		}
		if (e && k) {
			kill(child, SIGKILL);
			bx_free(k);
			k = NULL;
		}
	}
	if (e && c->step == BX_STEP_NONE)
		c->step = BX_STEP_CLONE;
	*err = e;
	return k;
}
