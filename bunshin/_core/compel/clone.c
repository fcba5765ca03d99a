/* Fork the seized process from inside: an injected clone3, optionally into another pid
 * namespace with a chosen pid. The child arrives attached (PTRACE_O_TRACEFORK) and stopped. */
#include <sched.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <linux/sched.h>

#include "internal.h"

#define LOG_PREFIX "clone: "

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

/* Each step's system calls run as one batch (batch.c) in the control block's page, so a clone
 * into another pid namespace costs four stops: [pidfd_open x2, setns, close], the clone3 alone
 * (its fork event and the child's attach are run_to_exit's), [setns back, close] in the
 * parent, [close, set_robust_list] in the child. */
static void call(struct bx_batch_entry *e, uint64_t ctl, unsigned long a0, unsigned long a1,
		 unsigned long a2)
{
	memset(e, 0, sizeof *e);
	e->ctl = ctl;
	e->args[0] = a0;
	e->args[1] = a1;
	e->args[2] = a2;
}

static long inject(struct bx_ctl *c, long nr, unsigned long a0, unsigned long a1,
		   unsigned long a2, int *err)
{
	unsigned long a[6] = {a0, a1, a2};
	long rv = -1;
	*err = bx_syscall_seized(c, nr, a, &rv);
	return rv;
}

/* What the clone needs of the injection thread, which cannot change while it is stopped: read
 * once per seize, as a /proc read or a peek costs about what an injection does. */
static int learn_self(struct bx_ctl *c)
{
	if (c->known)
		return 0;
	if (!c->nslevels) { /* known from the seize, unless this block came from a clone */
		pid_t ns[32];
		int n = bx_read_nspid(c->pid, ns, 32);
		if (n < 0)
			return n;
		c->nslevels = n;
	}
	c->tid_addr = bx_find_tid_addr(c, &c->thr[0]);
	if (bx_get_robust(c->thr[0].tid, &c->robust, &c->robust_len))
		c->robust = 0; /* none to give the child */
	c->known = 1;
	return 0;
}

int bx_learn_seized(struct bx_ctl *c)
{
	return learn_self(c);
}

/* setns() accepts only a pid namespace below the caller's own, so its members are visible
 * from the victim's namespace: the pid to open is the NSpid entry at the victim's depth. */
static int victim_view(struct bx_ctl *c, pid_t host_pid, pid_t *vpid)
{
	pid_t theirs[32];
	int nm = c->nslevels;
	int nt = bx_read_nspid(host_pid, theirs, 32);
	if (nt < 0)
		return nt;
	if (nt < nm)
		return -EINVAL;
	*vpid = theirs[nm - 1];
	return 0;
}

/* The child copy of everything the parent's control block knows, minus what it must not do:
 * it was never interrupted and has no held signals. */
static struct bx_ctl *adopt_child(struct bx_ctl *c, pid_t child, pid_t vtid, uint64_t flags,
				  int *err)
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
	k->wait_ns = c->wait_ns;
	if ((*err = bx_add_thread_as(k, child, vtid)) < 0) {
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
	/* an interrupted call stays interrupted: the kernel restarts it, or returns -EINTR to a
	 * signal's handler, as the child leaves its last ptrace stop (cure.c) */
	k->thr[0].regs = c->thr[0].regs;
	k->cur = k->thr[0].regs;
	memcpy(k->patch, c->patch, sizeof c->patch);
	k->npatch = c->npatch;
	k->scratch = c->scratch;
	if (flags & CLONE_VM) { /* the same memory, the same page: borrowed, never unmapped */
		k->page = c->page;
		k->page_fresh = c->page_fresh;
	}
	*err = 0;
	return k;
}

/* The child's pid in its own namespace when the request tells (0: read it from /proc). */
static pid_t child_vtid(const struct bx_clone_req *req)
{
	if (req->set_tid > 0)
		return req->set_tid;
	if (req->flags & CLONE_NEWPID)
		return 1;
	return 0; /* clone3's result is the pid in *our* namespace: not always the child's */
}

/* [pidfd_open target, pidfd_open home, setns target, close target]: 0 with *entered, or the
 * first error; *fd_target (-1 once closed) and *fd_home say what is open whatever happened. */
static int enter_pidns(struct bx_ctl *c, pid_t ns_vpid, int *fd_target, int *fd_home,
		       int *entered)
{
	struct bx_batch_entry in[4];
	size_t done = 0;
	call(&in[0], SYS_pidfd_open, ns_vpid, 0, 0);
	call(&in[1], SYS_pidfd_open, c->vpid, 0, 0);
	call(&in[2], SYS_setns | BX_BATCH_REF(0), 0, CLONE_NEWPID, 0);
	/* the child inherits no more than it must close: only the way home */
	call(&in[3], SYS_close | BX_BATCH_REF(0) | BX_BATCH_OK_ERR, 0, 0, 0);
	int e = bx_calls_seized(c, in, 4, &done);
	if (done > 0 && in[0].ret >= 0)
		*fd_target = (int)in[0].ret;
	if (done > 1 && in[1].ret >= 0)
		*fd_home = (int)in[1].ret;
	*entered = done > 2 && !in[2].ret;
	if (done > 3 && !in[3].ret)
		*fd_target = -1;
	for (size_t i = 0; !e && i < done && i < 3; i++)
		if (in[i].ret < 0)
			e = (int)in[i].ret;
	return e;
}

struct bx_ctl *bx_clone3_seized(struct bx_ctl *c, const struct bx_clone_req *req, int *err)
{
	int e = 0, fd_target = -1, fd_home = -1, entered = 0, inherited[2] = {-1, -1};
	long rv = 0;
	pid_t ns_vpid = 0, child = 0;
	struct bx_ctl *k = NULL;
	unsigned long scratch;
	struct bx_batch_entry tab[3];
	size_t n = 0, done;

	if ((e = bx_prepare_seized(c)) || (e = bx_scratch(c, &scratch)) || (e = learn_self(c)))
		goto out;
	unsigned long tid_addr = c->tid_addr;
	if (req->pidns_pid > 0) {
		c->step = BX_STEP_PIDNS;
		if ((e = victim_view(c, req->pidns_pid, &ns_vpid)) ||
		    (e = enter_pidns(c, ns_vpid, &fd_target, &fd_home, &entered)))
			goto out;
	}
	/* a page mapped but not yet kept out of forks must not reach a child */
	if (c->page && c->page_fresh && !(req->flags & CLONE_VM)) {
		rv = inject(c, SYS_madvise, c->page, BX_PAGE_SIZE, MADV_DONTFORK, &e);
		if (e || (e = (int)rv))
			goto out;
		c->page_fresh = 0;
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
		goto out;
	/* fork events only now: the victim's own forks must never be attached to us */
	c->step = BX_STEP_CLONE;
	if (ptrace(PTRACE_SETOPTIONS, c->thr[0].tid, 0, BX_SEIZE_OPTS | PTRACE_O_TRACEFORK)) {
		e = -errno;
		goto out;
	}
	c->last_child = 0;
	bx_log("%d: clone3 begins", c->pid);
	inherited[0] = fd_target;
	inherited[1] = fd_home;
	rv = inject(c, SYS_clone3, scratch, sizeof blk.args, 0, &e);
	ptrace(PTRACE_SETOPTIONS, c->thr[0].tid, 0, BX_SEIZE_OPTS);
	if (!e && rv < 0)
		e = (int)rv;
	if (!e && !(child = c->last_child))
		e = -ECHILD;
	bx_log("%d: clone3 = %ld, child %d", c->pid, rv, child);
out:
	/* home, and the pidfds closed: one batch */
	if (entered)
		call(&tab[n++], SYS_setns | BX_BATCH_OK_ERR, fd_home, CLONE_NEWPID, 0);
	if (fd_target >= 0)
		call(&tab[n++], SYS_close | BX_BATCH_OK_ERR, fd_target, 0, 0);
	if (fd_home >= 0)
		call(&tab[n++], SYS_close | BX_BATCH_OK_ERR, fd_home, 0, 0);
	if (n) {
		if (entered)
			c->step = BX_STEP_PIDNS;
		int e2 = bx_calls_seized(c, tab, n, &done);
		if (!e && (e2 || (entered && tab[0].ret)))
			e = e2 ? e2 : (int)tab[0].ret;
	}
	if (child > 0) {
		int e2 = 0;
		k = adopt_child(c, child, child_vtid(req), req->flags, &e2);
		bx_log("%d: child %d stopped", c->pid, child);
		if (k) {
			k->in_parent = (pid_t)rv;
			/* the child inherited our fds; fork() also dropped its robust list */
			n = 0;
			for (int i = 0; i < 2; i++)
				if (inherited[i] >= 0)
					call(&tab[n++], SYS_close | BX_BATCH_OK_ERR, inherited[i], 0, 0);
			if (c->robust && req->owe_robust) {
				k->owed_robust = c->robust;
				k->owed_robust_len = c->robust_len;
			} else if (c->robust) {
				call(&tab[n++], SYS_set_robust_list | BX_BATCH_OK_ERR, c->robust,
				     c->robust_len, 0);
			}
			/* in the borrowed page of a CLONE_VM child, else one by one (mapping a
			 * page for two calls would cost more than it saves) */
			e2 = bx_calls_run(k, tab, n, &done, 0);
		}
		if (e2 && !e) {
			c->step = BX_STEP_CHILD;
			e = e2;
		}
		if (e && k) {
			kill(child, SIGKILL);
			bx_free(k);
			k = NULL;
		} else if (!k) { /* its first stop never came: it must not run on */
			int st;
			kill(child, SIGKILL);
			while (!bx_wait(c, child, &st)) /* a stop reported before the kill */
				;
		}
	}
	if (e && c->step == BX_STEP_NONE)
		c->step = BX_STEP_CLONE;
	*err = e;
	return k;
}

/* A clone made by someone else (the kernel module's FORK), around which compel does what it
 * does around its own clone3: the victim prepared and its fresh page kept out of the child
 * before, the victim's stop collected and the child adopted after. */
int bx_clone_ext_begin(struct bx_ctl *c, unsigned long *tid_addr)
{
	int e;
	if ((e = bx_prepare_seized(c)) || (e = learn_self(c)))
		return e;
	if (c->page && c->page_fresh) {
		long rv = inject(c, SYS_madvise, c->page, BX_PAGE_SIZE, MADV_DONTFORK, &e);
		if (e || (e = (int)rv))
			return bx_fail(c, BX_STEP_CLONE, e);
		c->page_fresh = 0;
	}
	*tid_addr = c->tid_addr;
	return 0;
}

/* The victim was resumed and asked to stop again (PTRACE_EVENT_STOP): wait for that stop.
 * A signal that stops it first is held, as during an injection. Its registers may now show a
 * restarted system call; cure's or the next injection's saved registers are equally right. */
int bx_clone_ext_end(struct bx_ctl *c)
{
	pid_t tid = c->thr[0].tid;
	for (;;) {
		int st, e = bx_wait(c, tid, &st);
		if (e == -ETIMEDOUT) { /* stopped where it is, as after an injected call */
			bx_stop_overdue(c, tid, PTRACE_CONT);
			c->overdue = tid;
		}
		if (e)
			return bx_fail(c, BX_STEP_WAIT, e);
		int event = st >> 16, sig = WSTOPSIG(st);
		if (event == PTRACE_EVENT_STOP)
			return 0;
		if (!event && sig != (SIGTRAP | 0x80) && (e = bx_hold_signal(c, tid, sig)))
			return bx_fail(c, BX_STEP_SIGNALS, e);
		if (ptrace(PTRACE_CONT, tid, 0, 0))
			return bx_fail(c, BX_STEP_WAIT, -errno);
	}
}

/* One child of that clone, stopped before its first instruction and traced by us. */
struct bx_ctl *bx_clone_ext_adopt(struct bx_ctl *c, pid_t child, pid_t vtid, int *err)
{
	struct bx_ctl *k = adopt_child(c, child, vtid, 0, err);
	if (!k)
		c->step = BX_STEP_CHILD;
	return k;
}
