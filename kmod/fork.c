// SPDX-License-Identifier: GPL-2.0
/*
 * FORK: clone a stopped, traced task in the kernel, n children per call, each into a chosen pid
 * namespace with a chosen pid and parent.
 *
 * copy_process() copies *current*, so the copies must be made by the task itself: the ioctl
 * queues a task_work on it and resumes it from its ptrace stop (tracee.c); on its way back to
 * user mode the task runs the work (this file's fork_in_task), makes the children, asks for a
 * ptrace trap and stops again before a single user instruction.  The caller sleeps until then.  One
 * wake-up and one stop of the task for all the children, instead of a dozen injected system
 * calls per child.
 */
#define pr_fmt(fmt) "bunshin: fork: " fmt

#include <linux/bunshin.h>
#include <linux/capability.h>
#include <linux/cgroup.h>
#include <linux/cred.h>
#include <linux/fs_struct.h>
#include <linux/nsproxy.h>
#include <linux/pid_namespace.h>
#include <linux/ptrace.h>
#include <linux/sched/signal.h>
#include <linux/sched/task.h>
#include <linux/sched/task_stack.h>
#include <linux/slab.h>
#include <linux/uaccess.h>

#include "ksyms.h"
#include "refs.h"
#include "tracee.h"
#include "verbs.h"

struct fork_child {
	struct pid_namespace *ns;	/* where the child's pid is allocated */
	struct task_struct *parent;	/* its parent, a member of ns */
	pid_t tid;			/* its pid in ns, 0: any */
	pid_t pid;			/* out: in the caller's namespace */
};

struct fork_req {
	struct bunshin_tracee_work tw;
	struct pid_namespace *caller_ns;
	unsigned long child_tid;
	u32 flags;
	struct fork_child *kids;
	u32 n;
	u32 made;
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

/* IN_PARENT: the parent's namespaces as they are (its pid_ns_for_children must be the one the
 * child's pid comes from; a workspace's init has its own). */
static struct nsproxy *nsproxy_of_parent(struct fork_child *k)
{
	struct nsproxy *nsp;

	task_lock(k->parent);
	nsp = k->parent->nsproxy;
	if (nsp)
		get_nsproxy(nsp);
	task_unlock(k->parent);
	if (!nsp)
		return ERR_PTR(-ESRCH); /* exiting */
	if (nsp->pid_ns_for_children != k->ns) {
		put_nsproxy_ks(nsp);
		return ERR_PTR(-EXDEV);
	}
	return nsp;
}

/* IN_PARENT: current's fs_struct (its umask is the process's own) with the parent's root and
 * working directory, as setns() into the parent's mount namespace and a chdir would leave it. */
static struct fs_struct *fs_of_parent(struct task_struct *parent)
{
	struct path root = {}, pwd = {};
	struct fs_struct *fs;

	task_lock(parent);
	if (parent->fs) {
		get_fs_root(parent->fs, &root);
		get_fs_pwd(parent->fs, &pwd);
	}
	task_unlock(parent);
	if (!root.mnt)
		return ERR_PTR(-ESRCH);
	fs = bunshin_ks.copy_fs_struct(current->fs);
	if (!fs) {
		path_put(&root);
		path_put(&pwd);
		return ERR_PTR(-ENOMEM);
	}
	/* nobody else sees this copy yet: no lock */
	path_put(&fs->root);
	path_put(&fs->pwd);
	fs->root = root;
	fs->pwd = pwd;
	return fs;
}

/*
 * A task that dropped its privileges (a daemon under another uid) cannot take a chosen pid in
 * the child's namespace itself: alloc_pid() checks CAP_CHECKPOINT_RESTORE of current, and
 * current is the task.  The caller may (bunshin_fork() checked it), so the task is lent that
 * capability for the copy alone; the copy's credentials, copied from the lent ones, are then
 * replaced by the task's own before it ever runs.  NULL: nothing to lend.
 */
static const struct cred *lend_set_tid_cap(struct fork_child *k)
{
	struct cred *lent;
	const struct cred *own;

	if (!k->tid || checkpoint_restore_ns_capable_noaudit(k->ns->user_ns))
		return NULL;
#ifdef CONFIG_DEBUG_CREDENTIALS
	return ERR_PTR(-EPERM); /* its subscriber counts cannot be kept from a module */
#endif
	lent = prepare_creds();
	if (!lent)
		return ERR_PTR(-ENOMEM);
	cap_raise(lent->cap_effective, CAP_CHECKPOINT_RESTORE);
	own = override_creds(lent);
	put_cred(lent); /* current holds it until revert_creds() */
	return own;
}

/* The copy @p, not yet woken, gets the task's own credentials (@own, current's again) instead
 * of its copy of the lent ones: the same user and ucounts, so its process count stays right. */
static void give_own_creds(struct task_struct *p, const struct cred *own)
{
	const struct cred *lent_copy = p->real_cred;

	rcu_assign_pointer(p->real_cred, get_cred(own));
	rcu_assign_pointer(p->cred, get_cred(own));
	put_cred(lent_copy);
	put_cred(lent_copy);
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
	bool in_parent = req->flags & BUNSHIN_FORK_IN_PARENT;
	struct nsproxy *mine = current->nsproxy, *nsp;
	struct fs_struct *my_fs = current->fs, *fs = NULL;
	const struct cred *own;
	struct task_struct *p;
	int err;

	nsp = in_parent ? nsproxy_of_parent(k) : nsproxy_for(k->ns);
	if (IS_ERR(nsp))
		return PTR_ERR(nsp);
	if (in_parent) {
		fs = fs_of_parent(k->parent);
		if (IS_ERR(fs)) {
			put_nsproxy_ks(nsp);
			return PTR_ERR(fs);
		}
	}
	own = lend_set_tid_cap(k);
	if (IS_ERR(own)) {
		put_nsproxy_ks(nsp);
		if (fs)
			bunshin_ks.free_fs_struct(fs);
		return PTR_ERR(own);
	}
	/* copy_process() copies current's: lend it the child's for the call.  The task's own
	 * are shared by the whole workspace (and its fs by its threads) and stay as they are. */
	task_lock(current);
	current->nsproxy = nsp;
	if (fs)
		current->fs = fs;
	task_unlock(current);
	/* traced: the child starts with a PTRACE_EVENT_STOP for our caller (it seized us) */
	p = bunshin_ks.copy_process(NULL, 1, NUMA_NO_NODE, &args);
	if (own) {
		revert_creds(own);
		if (!IS_ERR(p))
			give_own_creds(p, own);
	}
	task_lock(current);
	current->nsproxy = mine;
	current->fs = my_fs;
	task_unlock(current);
	put_nsproxy_ks(nsp);
	if (fs)
		bunshin_ks.free_fs_struct(fs); /* the child has a copy */
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
	if (!in_parent)
		return 0;
	/* only now: the cpu controller refuses a task not yet woken (TASK_NEW). It runs no user
	 * code before its stop, so nothing it does is counted in the template's groups. */
	err = cgroup_attach_task_all(k->parent, p);
	if (err)
		pr_debug("pid %d into its parent's cgroups: %d\n", k->pid, err);
	return err; /* made either way: k->pid says so */
}

/* Runs in the task being cloned, on its way to user mode. */
static int fork_in_task(struct bunshin_tracee_work *tw)
{
	struct fork_req *req = container_of(tw, struct fork_req, tw);
	int err = 0;
	u32 i;

	for (i = 0; !err && i < req->n; i++) {
		err = fork_one(req, &req->kids[i]);
		if (req->kids[i].pid)
			req->made++;
	}
	return err;
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
	struct fork_req req = { .made = 0 };
	struct task_struct *task;
	long ret;
	u32 i;

	if (copy_from_user(&f, uarg, sizeof(f)))
		return -EFAULT;
	if ((f.flags & ~BUNSHIN_FORK_IN_PARENT) || f.resumed || f.done || f.pid <= 0 ||
	    f.child_size != sizeof(in))
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
	/* joining another task's mount and other namespaces is setns()'s power, not C/R's */
	if ((f.flags & BUNSHIN_FORK_IN_PARENT) && !capable(CAP_SYS_ADMIN))
		return -EPERM;

	task = bunshin_get_task(f.pid);
	if (!task)
		return -ESRCH;
	/* the caller's own tracee, in a stop it made it report: the state ptrace calls need */
	ret = bunshin_tracee_check(task);
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
	req.flags = f.flags;
	req.tw.fn = fork_in_task;
	ret = bunshin_tracee_run(task, &req.tw);
	f.resumed = req.tw.resumed;

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
