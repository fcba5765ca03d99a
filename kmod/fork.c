// SPDX-License-Identifier: GPL-2.0
/*
 * FORK: clone a stopped, traced task in the kernel, n children per call, each into a chosen pid
 * namespace with a chosen pid and parent.
 *
 * copy_process() copies *current*, so the copies must be made by the task itself: the ioctl
 * queues a task_work on it and resumes it from its ptrace stop; on its way back to user mode
 * the task runs the work (this file's fork_in_task), makes the children, asks for a ptrace
 * trap and stops again before a single user instruction.  The caller sleeps until then.  One
 * wake-up and one stop of the task for all the children, instead of a dozen injected system
 * calls per child.
 */
#define pr_fmt(fmt) "bunshin: fork: " fmt

#include <linux/bunshin.h>
#include <linux/capability.h>
#include <linux/moduleparam.h>
#include <linux/completion.h>
#include <linux/nsproxy.h>
#include <linux/pid_namespace.h>
#include <linux/ptrace.h>
#include <linux/sched/signal.h>
#include <linux/sched/task.h>
#include <linux/sched/task_stack.h>
#include <linux/slab.h>
#include <linux/task_work.h>
#include <linux/uaccess.h>

#include "ksyms.h"
#include "refs.h"
#include "verbs.h"

/* A task that does not reach its work this long after being resumed is stuck somewhere the
 * caller should hear about (a signal stop that came first).  Tests set 0 (give up at once)
 * to race the path that takes the work back. */
static unsigned int fork_timeout_ms = 2000;
module_param(fork_timeout_ms, uint, 0644);
MODULE_PARM_DESC(fork_timeout_ms, "FORK: how long a resumed task may take to reach its work (ms)");

struct fork_child {
	struct pid_namespace *ns;	/* where the child's pid is allocated */
	struct task_struct *parent;	/* its parent, a member of ns */
	pid_t tid;			/* its pid in ns, 0: any */
	pid_t pid;			/* out: in the caller's namespace */
};

struct fork_req {
	struct callback_head work;
	struct completion done;
	struct pid_namespace *caller_ns;
	unsigned long child_tid;
	struct fork_child *kids;
	u32 n;
	u32 made;
	int err;
};

/* current's namespaces but with @ns as the one its children's pids come from: the task's own
 * nsproxy is shared by the whole workspace and must not change even for a moment. */
static struct nsproxy *nsproxy_for(struct pid_namespace *ns)
{
	struct nsproxy *nsp = bunshin_ks.create_new_namespaces(0, current, current_user_ns(),
							       current->fs);

	if (IS_ERR(nsp))
		return nsp;
	put_pid_ns(nsp->pid_ns_for_children);
	nsp->pid_ns_for_children = get_pid_ns(ns);
	return nsp;
}

static void put_nsproxy_ks(struct nsproxy *nsp)
{
	if (atomic_dec_and_test(&nsp->count))
		bunshin_ks.free_nsproxy(nsp);
}

/* Put @p (not yet running) under @parent, as if @parent had forked it.  A parent that died
 * meanwhile leaves the child to its namespace's init, as an orphan would be. */
static void adopt(struct task_struct *p, struct fork_child *k)
{
	struct task_struct *parent = k->parent;

	write_lock_irq(bunshin_ks.tasklist_lock);
	if ((parent->flags & PF_EXITING) || parent->exit_state)
		parent = k->ns->child_reaper;
	if (parent && !(parent->flags & PF_EXITING) && !parent->exit_state) {
		list_move_tail(&p->sibling, &parent->children);
		p->real_parent = parent;
		if (!p->ptrace)
			p->parent = parent;
		p->parent_exec_id = parent->self_exec_id;
		p->signal->has_child_subreaper = parent->signal->has_child_subreaper ||
						 parent->signal->is_child_subreaper;
	}
	write_unlock_irq(bunshin_ks.tasklist_lock);
}

static int fork_one(struct fork_req *req, struct fork_child *k)
{
	struct kernel_clone_args args = {
		.flags = req->child_tid ? CLONE_CHILD_SETTID : 0,
		.child_tid = (int __user *)req->child_tid,
		.exit_signal = SIGCHLD,
		.set_tid = &k->tid,
		.set_tid_size = k->tid ? 1 : 0,
	};
	struct nsproxy *mine = current->nsproxy, *nsp;
	struct task_struct *p;

	nsp = nsproxy_for(k->ns);
	if (IS_ERR(nsp))
		return PTR_ERR(nsp);
	task_lock(current);
	current->nsproxy = nsp;
	task_unlock(current);
	/* traced: the child starts with a PTRACE_EVENT_STOP for our caller (it seized us) */
	p = bunshin_ks.copy_process(NULL, 1, NUMA_NO_NODE, &args);
	task_lock(current);
	current->nsproxy = mine;
	task_unlock(current);
	put_nsproxy_ks(nsp);
	/* a signal or a freezer trap came for the task meanwhile: a syscall would restart the
	 * fork after handling it; our caller is told to call again */
	if (p == ERR_PTR(-ERESTARTNOINTR))
		return -EAGAIN;
	if (IS_ERR(p))
		return PTR_ERR(p);

	/* copy_thread() made the child's fork() return 0; it must return what ours will */
	task_pt_regs(p)->ax = current_pt_regs()->ax;
#ifdef CONFIG_FUTEX
	p->robust_list = current->robust_list; /* fork drops it; these are clones, not forks */
#endif
	adopt(p, k);
	k->pid = task_pid_nr_ns(p, req->caller_ns);
#ifdef CONFIG_LRU_GEN
	/* as kernel_clone() does: the multi-gen LRU walks the page tables of listed mms */
	task_lock(p);
	bunshin_ks.lru_gen_add_mm(p->mm);
	task_unlock(p);
#endif
	bunshin_ks.wake_up_new_task(p);
	return 0;
}

/* Make a seized task stop in a PTRACE_EVENT_STOP before it runs user code again, as
 * PTRACE_INTERRUPT does; an exiting task is left to exit. */
static void ask_to_trap(struct task_struct *task)
{
	spin_lock_irq(&task->sighand->siglock);
	if (task->ptrace & PT_SEIZED && !(task->flags & PF_EXITING)) {
		task->jobctl |= JOBCTL_TRAP_STOP;
		bunshin_ks.signal_wake_up_state(task, 0);
	}
	spin_unlock_irq(&task->sighand->siglock);
}

/* Runs in the task being cloned, on its way to user mode. */
static void fork_in_task(struct callback_head *work)
{
	struct fork_req *req = container_of(work, struct fork_req, work);
	u32 i;

	req->err = 0;
	if (current->flags & PF_EXITING || fatal_signal_pending(current))
		req->err = -ESRCH;
	for (i = 0; !req->err && i < req->n; i++) {
		req->err = fork_one(req, &req->kids[i]);
		if (!req->err)
			req->made++;
	}
	ask_to_trap(current); /* our caller still has work to do here */
	complete(&req->done); /* last touch: req lives on the caller's stack */
}

static bool unblocked(const sigset_t *pending, const sigset_t *blocked)
{
	sigset_t s;

	sigandnsets(&s, pending, blocked);
	return !sigisemptyset(&s);
}

/* PTRACE_CONT, for a task the caller traces and that sits in a ptrace stop, with the work
 * queued first so it cannot reach user mode without running it. */
static int queue_and_resume(struct task_struct *task, struct fork_req *req)
{
	int ret = -EBUSY;

	spin_lock_irq(&task->sighand->siglock);
	if (!task_is_traced(task) || (task->jobctl & JOBCTL_LISTENING) ||
	    __fatal_signal_pending(task))
		goto out;
	/* a signal waiting for it would stop it again, for us, before the work: ask for a retry */
	ret = -EAGAIN;
	if (unblocked(&task->pending.signal, &task->blocked) ||
	    unblocked(&task->signal->shared_pending.signal, &task->blocked))
		goto out;
	ret = task_work_add(task, &req->work, TWA_SIGNAL);
	if (ret)
		goto out;
	clear_task_syscall_work(task, SYSCALL_TRACE);
	clear_task_syscall_work(task, SYSCALL_EMU);
	task->exit_code = 0;
	task->jobctl &= ~JOBCTL_TRACED;
	bunshin_ks.wake_up_state(task, __TASK_TRACED);
out:
	spin_unlock_irq(&task->sighand->siglock);
	return ret;
}

/* The caller gave up waiting: take the work back, or wait for it if it already runs.  A task
 * that never ran it is asked to stop, so it does not go on in user mode unseen. */
static int abandon(struct task_struct *task, struct fork_req *req, int why)
{
	if (bunshin_ks.task_work_cancel(task, &req->work)) {
		ask_to_trap(task);
		return why;
	}
	wait_for_completion(&req->done); /* running now: it is short */
	return req->err;
}

static bool pidns_below(struct pid_namespace *ns, struct pid_namespace *top)
{
	for (; ns; ns = ns->parent)
		if (ns == top)
			return true;
	return false;
}

static void put_kids(struct fork_child *kids, u32 n)
{
	u32 i;

	for (i = 0; i < n; i++) {
		if (kids[i].parent)
			bunshin_put_task(kids[i].parent);
		if (kids[i].ns)
			put_pid_ns(kids[i].ns);
	}
}

/* Resolve one child's namespace and parent; caller-namespace pids, checked like REPARENT's. */
static int resolve_child(struct task_struct *task, const struct bunshin_fork_child *in,
			 struct fork_child *k)
{
	struct task_struct *owner;
	u32 j;

	for (j = 0; j < ARRAY_SIZE(in->reserved); j++)
		if (in->reserved[j])
			return -EINVAL;
	if (in->pidns_pid < 0 || in->tid < 0 || in->parent < 0 || in->pid)
		return -EINVAL;
	owner = in->pidns_pid ? bunshin_get_task(in->pidns_pid) : NULL;
	if (in->pidns_pid && !owner)
		return -ESRCH;
	k->ns = task_active_pid_ns(owner ? owner : task);
	if (k->ns)
		get_pid_ns(k->ns);
	if (owner)
		bunshin_put_task(owner);
	if (!k->ns)
		return -ESRCH; /* exiting */
	if (!pidns_below(k->ns, task_active_pid_ns(task)))
		return -EXDEV;
	if (in->parent) {
		k->parent = bunshin_get_task(in->parent);
		if (!k->parent)
			return -ESRCH;
	} else {
		rcu_read_lock();
		k->parent = k->ns->child_reaper;
		if (k->parent) {
			get_task_struct(k->parent);
			bunshin_ref_get(BUNSHIN_REF_TASK);
		}
		rcu_read_unlock();
		if (!k->parent)
			return -ESRCH;
	}
	if (task_active_pid_ns(k->parent) != k->ns || !thread_group_leader(k->parent))
		return -EXDEV;
	if (!bunshin_ks.ptrace_may_access(k->parent, PTRACE_MODE_ATTACH_REALCREDS))
		return -EPERM;
	k->tid = in->tid;
	return 0;
}

long bunshin_fork(void __user *uarg)
{
	struct bunshin_fork f;
	struct bunshin_fork_child __user *uk;
	struct bunshin_fork_child in;
	struct fork_req req = { .err = 0 };
	struct task_struct *task;
	long ret, left;
	unsigned int timeout;
	u32 i;

	if (copy_from_user(&f, uarg, sizeof(f)))
		return -EFAULT;
	if (f.flags || f.resumed || f.done || f.pid <= 0 || f.child_size != sizeof(in))
		return -EINVAL;
	for (i = 0; i < ARRAY_SIZE(f.reserved); i++)
		if (f.reserved[i])
			return -EINVAL;
	if (!f.nchildren)
		return -EINVAL;
	if (f.nchildren > BUNSHIN_FORK_MAX_CHILDREN)
		return -E2BIG;
	if (!capable(CAP_SYS_ADMIN) && !capable(CAP_CHECKPOINT_RESTORE))
		return -EPERM;

	task = bunshin_get_task(f.pid);
	if (!task)
		return -ESRCH;
	/* the caller's own tracee, in a stop it made it report: the state ptrace calls need */
	ret = -EBUSY;
	read_lock(bunshin_ks.tasklist_lock);
	if (task->ptrace & PT_SEIZED && task->parent == current && !task->exit_state)
		ret = 0;
	read_unlock(bunshin_ks.tasklist_lock);
	if (ret)
		goto put_task;

	req.kids = kcalloc(f.nchildren, sizeof(*req.kids), GFP_KERNEL);
	ret = -ENOMEM;
	if (!req.kids)
		goto put_task;
	req.n = f.nchildren;
	uk = u64_to_user_ptr(f.children_ptr);
	for (i = 0; i < f.nchildren; i++) {
		ret = -EFAULT;
		if (copy_from_user(&in, &uk[i], sizeof(in)))
			goto put_kids;
		ret = resolve_child(task, &in, &req.kids[i]);
		if (ret)
			goto put_kids;
	}

	req.caller_ns = task_active_pid_ns(current);
	req.child_tid = f.child_tid;
	init_completion(&req.done);
	init_task_work(&req.work, fork_in_task);
	ret = queue_and_resume(task, &req);
	if (ret)
		goto put_kids;
	f.resumed = 1;
	timeout = READ_ONCE(fork_timeout_ms);
	left = timeout ? wait_for_completion_killable_timeout(&req.done, msecs_to_jiffies(timeout))
		       : 0; /* a zero timeout still sleeps a tick: 0 gives up at once */
	if (left > 0)
		ret = req.err;
	else
		ret = abandon(task, &req, left ? -EINTR : -ETIMEDOUT);

	f.done = req.made;
	for (i = 0; i < req.made; i++) {
		if (copy_from_user(&in, &uk[i], sizeof(in)))
			continue; /* the children exist whatever happens to the report */
		in.pid = req.kids[i].pid;
		if (copy_to_user(&uk[i], &in, sizeof(in)) && !ret)
			ret = -EFAULT;
	}
	if (copy_to_user(uarg, &f, sizeof(f)) && !ret)
		ret = -EFAULT;
put_kids:
	put_kids(req.kids, req.n);
	kfree(req.kids);
put_task:
	bunshin_put_task(task);
	return ret;
}
