// SPDX-License-Identifier: GPL-2.0
/* Resuming a stopped tracee to do work in its own context, then stopping it again. */
#define pr_fmt(fmt) "bunshin: tracee: " fmt

#include <linux/moduleparam.h>
#include <linux/ptrace.h>
#include <linux/sched/signal.h>

#include "ksyms.h"
#include "tracee.h"

/* A task that does not reach its work this long after being resumed is stuck somewhere the
 * caller should hear about (a signal stop that came first).  Tests set 0 (give up at once)
 * to race the path that takes the work back. */
static unsigned int fork_timeout_ms = 2000;
module_param(fork_timeout_ms, uint, 0644);
MODULE_PARM_DESC(fork_timeout_ms,
		 "FORK, RUN: how long a resumed task may take to reach its work (ms)");

int bunshin_tracee_check(struct task_struct *task)
{
	int ret = -EBUSY;

	read_lock(bunshin_ks.tasklist_lock);
	if (task->ptrace & PT_SEIZED && task->parent == current && !task->exit_state)
		ret = 0;
	read_unlock(bunshin_ks.tasklist_lock);
	return ret;
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

static void work_in_task(struct callback_head *work)
{
	struct bunshin_tracee_work *tw = container_of(work, struct bunshin_tracee_work, work);

	/* TWA_SIGNAL's flag is still set when the work runs from the resume-to-user path rather
	 * than get_signal(): it makes signal_pending() true, which fails copy_process() and any
	 * interruptible sleep of a RUN call at once.  It has done its job (we run), and a work
	 * queued after this sets it again. */
	clear_notify_signal();
	if (current->flags & PF_EXITING || fatal_signal_pending(current))
		tw->err = -ESRCH;
	else
		tw->err = tw->fn(tw);
	ask_to_trap(current); /* our caller still has work to do here */
	complete(&tw->done); /* last touch: tw lives on the caller's stack */
}

static bool unblocked(const sigset_t *pending, const sigset_t *blocked)
{
	sigset_t s;

	sigandnsets(&s, pending, blocked);
	return !sigisemptyset(&s);
}

/* PTRACE_CONT, for a task the caller traces and that sits in a ptrace stop, with the work
 * queued first so it cannot reach user mode without running it. */
static int queue_and_resume(struct task_struct *task, struct bunshin_tracee_work *tw)
{
	int ret = -EBUSY;

	spin_lock_irq(&task->sighand->siglock);
	if (!task_is_traced(task) || (task->jobctl & JOBCTL_LISTENING) ||
	    __fatal_signal_pending(task))
		goto out;
	/* A signal waiting for it would stop it again, for us, before the work, and so would a
	 * trap already asked for (get_signal() takes traps before it returns to the work): a
	 * PTRACE_INTERRUPT that found the task stopped (seizing a task in a group stop leaves
	 * one), a job control event, a group stop.  Ask for a retry, nothing resumed: the caller's
	 * next ptrace resume of the task lets it take them. */
	ret = -EAGAIN;
	if ((task->jobctl & JOBCTL_PENDING_MASK) ||
	    unblocked(&task->pending.signal, &task->blocked) ||
	    unblocked(&task->signal->shared_pending.signal, &task->blocked))
		goto out;
	ret = task_work_add(task, &tw->work, TWA_SIGNAL);
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
static int abandon(struct task_struct *task, struct bunshin_tracee_work *tw, int why)
{
	if (bunshin_ks.task_work_cancel(task, &tw->work)) {
		ask_to_trap(task);
		return why;
	}
	wait_for_completion(&tw->done); /* running now: it is short */
	return tw->err;
}

int bunshin_tracee_run(struct task_struct *task, struct bunshin_tracee_work *tw)
{
	unsigned int timeout;
	long left;
	int ret;

	tw->err = 0;
	tw->resumed = false;
	init_completion(&tw->done);
	init_task_work(&tw->work, work_in_task);
	ret = queue_and_resume(task, tw);
	if (ret)
		return ret;
	tw->resumed = true;
	timeout = READ_ONCE(fork_timeout_ms);
	left = timeout ? wait_for_completion_killable_timeout(&tw->done, msecs_to_jiffies(timeout))
		       : 0; /* a zero timeout still sleeps a tick: 0 gives up at once */
	if (left > 0)
		return tw->err;
	return abandon(task, tw, left ? -EINTR : -ETIMEDOUT);
}
