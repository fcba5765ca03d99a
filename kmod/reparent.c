// SPDX-License-Identifier: GPL-2.0
/* REPARENT: move a task (with its threads) under a new parent in its pid namespace. */
#define pr_fmt(fmt) "bunshin: reparent: " fmt

#include <linux/bunshin.h>
#include <linux/capability.h>
#include <linux/pid_namespace.h>
#include <linux/ptrace.h>
#include <linux/sched/signal.h>
#include <linux/sched/task.h>
#include <linux/uaccess.h>

#include "ksyms.h"
#include "refs.h"
#include "verbs.h"

/* Is @anc an ancestor of @t (or @t itself)?  Called under tasklist_lock. */
static bool is_ancestor(struct task_struct *anc, struct task_struct *t)
{
	while (t && !is_global_init(t) && t != t->real_parent) {
		if (same_thread_group(t, anc))
			return true;
		t = t->real_parent;
	}
	return t && same_thread_group(t, anc);
}

static long do_reparent(struct task_struct *task, struct task_struct *parent,
			struct bunshin_reparent *req)
{
	struct task_struct *t;
	long ret = 0;

	write_lock_irq(bunshin_ks.tasklist_lock);
	if ((task->flags | parent->flags) & PF_EXITING || task->exit_state || parent->exit_state) {
		ret = -ESRCH;
		goto out;
	}
	if (!thread_group_leader(task) || !thread_group_leader(parent)) {
		ret = -EINVAL;
		goto out;
	}
	if (is_ancestor(task, parent)) {
		ret = -EINVAL; /* the new parent is the task or below it: a cycle */
		goto out;
	}
	/* A tracer of ours keeps its tracee; only the real parent moves. */
	if (req->flags & BUNSHIN_REPARENT_TRACED ? task->parent != current || !task->ptrace
						   : task->ptrace) {
		ret = -EBUSY;
		goto out;
	}
	req->old_parent = task_pid_vnr(task->real_parent);
	list_move_tail(&task->sibling, &parent->children);
	for_each_thread(task, t) {
		rcu_assign_pointer(t->real_parent, parent);
		if (!t->ptrace)
			t->parent = parent;
	}
out:
	write_unlock_irq(bunshin_ks.tasklist_lock);
	return ret;
}

long bunshin_reparent(void __user *uarg)
{
	struct bunshin_reparent req;
	struct task_struct *task, *parent;
	long ret;
	int i;

	if (copy_from_user(&req, uarg, sizeof(req)))
		return -EFAULT;
	if ((req.flags & ~BUNSHIN_REPARENT_TRACED) || req.pad || req.pad2 || req.pid <= 0 || req.new_parent <= 0 ||
	    req.pid == req.new_parent)
		return -EINVAL;
	for (i = 0; i < ARRAY_SIZE(req.reserved); i++)
		if (req.reserved[i])
			return -EINVAL;
	if (!capable(CAP_SYS_ADMIN) && !capable(CAP_CHECKPOINT_RESTORE))
		return -EPERM;

	task = bunshin_get_task(req.pid);
	if (!task)
		return -ESRCH;
	parent = bunshin_get_task(req.new_parent);
	if (!parent) {
		ret = -ESRCH;
		goto put_task;
	}
	ret = -EXDEV;
	if (task_active_pid_ns(task) != task_active_pid_ns(parent))
		goto put_both;
	ret = -EPERM;
	if (!bunshin_ks.ptrace_may_access(task, PTRACE_MODE_ATTACH_REALCREDS) ||
	    !bunshin_ks.ptrace_may_access(parent, PTRACE_MODE_ATTACH_REALCREDS))
		goto put_both;
	ret = do_reparent(task, parent, &req);
	if (!ret && copy_to_user(uarg, &req, sizeof(req)))
		ret = -EFAULT; /* the move is done; only the report failed */
put_both:
	bunshin_put_task(parent);
put_task:
	bunshin_put_task(task);
	return ret;
}
