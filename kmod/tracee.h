/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Work a seized, ptrace-stopped task does for its tracer in its own context: FORK (copies of
 * itself) and RUN (system calls).  The ioctl queues the work on the task and resumes it; on
 * its way back to user mode the task runs it, asks for a PTRACE_INTERRUPT-style trap and stops
 * again before a single user instruction; the ioctl sleeps until then.
 */
#ifndef BUNSHIN_TRACEE_H
#define BUNSHIN_TRACEE_H

#include <linux/completion.h>
#include <linux/sched.h>
#include <linux/task_work.h>

struct bunshin_tracee_work {
	struct callback_head work;
	struct completion done;
	/* runs in the task; returns 0 or -errno, what bunshin_tracee_run() returns */
	int (*fn)(struct bunshin_tracee_work *tw);
	int err;
	bool resumed;	/* out: the task was resumed: it stops again, its tracer waits for that */
};

/* 0 when @task is a thread the calling thread has seized (PTRACE_SEIZE), else -EBUSY. */
int bunshin_tracee_check(struct task_struct *task);

/* Resume @task (which must pass bunshin_tracee_check and sit in a ptrace stop) to run
 * @tw->fn, and wait for it (module parameter fork_timeout_ms bounds how long it may take to
 * get there).  Returns fn's result, or -EBUSY (not in a ptrace stop), -EAGAIN (an unblocked
 * signal or a trap is pending: it would stop for that first; not resumed), -ETIMEDOUT,
 * -EINTR (the caller was killed).  @tw lives on the caller's stack. */
int bunshin_tracee_run(struct task_struct *task, struct bunshin_tracee_work *tw);

#endif
