/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Every reference a verb takes goes through these helpers, which count gets
 * and puts; /sys/kernel/debug/bunshin/refs shows the counts so tests can
 * prove nothing leaked.
 */
#ifndef BUNSHIN_REFS_H
#define BUNSHIN_REFS_H

#include <linux/sched/mm.h>
#include <linux/sched/task.h>
#include <linux/pid.h>

enum bunshin_ref {
	BUNSHIN_REF_TASK,
	BUNSHIN_REF_MM,
	BUNSHIN_REF_PFNS,	/* the per-call pfn xarray of share_stats.c */
	BUNSHIN_NR_REFS,
};

void bunshin_ref_get(enum bunshin_ref ref);
void bunshin_ref_put(enum bunshin_ref ref);
void bunshin_refs_init(void);
void bunshin_refs_exit(void);

/* Task with pid @nr in the caller's pid namespace, or NULL. */
static inline struct task_struct *bunshin_get_task(pid_t nr)
{
	struct task_struct *task;

	rcu_read_lock();
	task = pid_task(find_vpid(nr), PIDTYPE_PID);
	if (task)
		get_task_struct(task);
	rcu_read_unlock();
	if (task)
		bunshin_ref_get(BUNSHIN_REF_TASK);
	return task;
}

static inline void bunshin_put_task(struct task_struct *task)
{
	bunshin_ref_put(BUNSHIN_REF_TASK);
	put_task_struct(task);
}

static inline void bunshin_put_mm(struct mm_struct *mm)
{
	bunshin_ref_put(BUNSHIN_REF_MM);
	mmput(mm);
}

#endif
