// SPDX-License-Identifier: GPL-2.0
/*
 * JOIN_SESSION: move a process into another process's session and process group, with the
 * session's controlling terminal.
 *
 * A session can only be inherited at fork, from a process in it; a clone of a shell's job is
 * forked from the job's template, whose session (the template shell's) lies outside the
 * child's pid namespace.  setsid()/setpgid() cannot join an existing session.  This does what
 * fork would have done had the clone of the shell forked the clone of the job: the same
 * change_pid() calls setsid() and setpgid() make, under the tasklist lock.
 */
#define pr_fmt(fmt) "bunshin: session: " fmt

#include <linux/bunshin.h>
#include <linux/capability.h>
#include <linux/pid_namespace.h>
#include <linux/ptrace.h>
#include <linux/sched/signal.h>
#include <linux/tty.h>
#include <linux/uaccess.h>

#include "ksyms.h"
#include "refs.h"
#include "verbs.h"

static int check_task(struct task_struct *t, struct pid_namespace *ns)
{
	if (!thread_group_leader(t))
		return -EINVAL;
	if (task_active_pid_ns(t) != ns)
		return -EXDEV;
	if (!bunshin_ks.ptrace_may_access(t, PTRACE_MODE_ATTACH_REALCREDS))
		return -EPERM;
	return 0;
}

/* Under the tasklist lock: the move itself, or why not. */
static int move(struct task_struct *p, struct task_struct *s, struct task_struct *g,
		struct bunshin_join_session *j)
{
	struct pid_namespace *caller = task_active_pid_ns(current);
	struct pid *sid, *pgrp;

	if (p->exit_state || (p->flags & PF_EXITING) || s->exit_state || (g && g->exit_state))
		return -ESRCH;
	if (p->signal->leader)
		return -EINVAL; /* a session leader's session is its own */
	sid = task_session(s);
	pgrp = g ? task_pgrp(g) : task_pid(p);
	if (!sid || !pgrp || (g && task_session(g) != sid))
		return -EINVAL;
	j->old_sid = pid_nr_ns(task_session(p), caller);
	j->old_pgid = pid_nr_ns(task_pgrp(p), caller);
	if (task_session(p) != sid)
		bunshin_ks.change_pid(p, PIDTYPE_SID, sid);
	if (task_pgrp(p) != pgrp)
		bunshin_ks.change_pid(p, PIDTYPE_PGID, pgrp);
	return 0;
}

long bunshin_join_session(void __user *uarg)
{
	struct bunshin_join_session j;
	struct task_struct *p = NULL, *s = NULL, *g = NULL;
	struct tty_struct *tty = NULL;
	struct pid_namespace *ns;
	long ret;
	size_t i;

	if (copy_from_user(&j, uarg, sizeof(j)))
		return -EFAULT;
	if (j.flags || j.pid <= 0 || j.session_of <= 0 || j.pgrp_of <= 0)
		return -EINVAL;
	for (i = 0; i < ARRAY_SIZE(j.reserved); i++)
		if (j.reserved[i])
			return -EINVAL;
	if (!capable(CAP_SYS_ADMIN) && !capable(CAP_CHECKPOINT_RESTORE))
		return -EPERM;

	ret = -ESRCH;
	p = bunshin_get_task(j.pid);
	s = bunshin_get_task(j.session_of);
	if (j.pgrp_of != j.pid)
		g = bunshin_get_task(j.pgrp_of);
	if (!p || !s || (j.pgrp_of != j.pid && !g))
		goto put;
	ns = task_active_pid_ns(p);
	ret = -ESRCH;
	if (!ns)
		goto put;
	ret = check_task(p, ns);
	if (!ret)
		ret = check_task(s, ns);
	if (!ret && g)
		ret = check_task(g, ns);
	if (ret)
		goto put;

	write_lock_irq(bunshin_ks.tasklist_lock);
	ret = move(p, s, g, &j);
	if (!ret) {
		/* the session's terminal for its old one; ->tty is under each one's siglock, and
		 * neither sighand can go while we hold the tasklist lock (both are alive) */
		spin_lock(&s->sighand->siglock);
		tty = tty_kref_get(s->signal->tty);
		spin_unlock(&s->sighand->siglock);
		spin_lock(&p->sighand->siglock);
		swap(p->signal->tty, tty);
		spin_unlock(&p->sighand->siglock);
	}
	write_unlock_irq(bunshin_ks.tasklist_lock);
	tty_kref_put(tty); /* the old terminal, or the new one unused */

	memset(j.reserved, 0, sizeof(j.reserved));
	if (!ret && copy_to_user(uarg, &j, sizeof(j)))
		ret = -EFAULT;
put:
	if (g)
		bunshin_put_task(g);
	if (s)
		bunshin_put_task(s);
	if (p)
		bunshin_put_task(p);
	return ret;
}
