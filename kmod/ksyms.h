/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Kernel functions and data the verbs need that Debian's 6.1 kernel does not
 * export to modules.  They are looked up once at load; the module refuses to
 * load if one is missing, so a verb never runs half-resolved.
 */
#ifndef BUNSHIN_KSYMS_H
#define BUNSHIN_KSYMS_H

#include <linux/mm_types.h>
#include <linux/pagewalk.h>
#include <linux/sched.h>
#include <linux/sched/task.h>
#include <asm/syscall.h>

struct bunshin_ksyms {
	int (*walk_page_range)(struct mm_struct *mm, unsigned long start,
			       unsigned long end, const struct mm_walk_ops *ops,
			       void *private);
	/* mm_access() is ptrace_may_access() + get_task_mm() under the
	 * exec lock, the check /proc/PID/pagemap itself makes. */
	struct mm_struct *(*mm_access)(struct task_struct *task,
				       unsigned int mode);
	spinlock_t *(*__pmd_trans_huge_lock)(pmd_t *pmd,
					     struct vm_area_struct *vma);
	unsigned long *huge_zero_pfn;
	unsigned long *max_pfn;		/* highest pfn of RAM + 1 */
	bool (*ptrace_may_access)(struct task_struct *task, unsigned int mode);
	rwlock_t *tasklist_lock;
	/* fork.c: the halves of kernel_clone() it runs in the task itself */
	struct task_struct *(*copy_process)(struct pid *pid, int trace, int node,
					    struct kernel_clone_args *args);
	void (*wake_up_new_task)(struct task_struct *p);
	struct nsproxy *(*create_new_namespaces)(unsigned long flags,
						 struct task_struct *tsk,
						 struct user_namespace *user_ns,
						 struct fs_struct *new_fs);
	void (*free_nsproxy)(struct nsproxy *ns);
	/* FORK IN_PARENT: the child's fs_struct, made from a copy of current's */
	struct fs_struct *(*copy_fs_struct)(struct fs_struct *old);
	void (*free_fs_struct)(struct fs_struct *fs);
	bool (*task_work_cancel)(struct task_struct *task, struct callback_head *cb);
	int (*wake_up_state)(struct task_struct *p, unsigned int state);
	void (*signal_wake_up_state)(struct task_struct *t, unsigned int state);
#ifdef CONFIG_LRU_GEN
	void (*lru_gen_add_mm)(struct mm_struct *mm);
#endif
	/* run.c: each system call's entry point (x86_64 table: they take a pt_regs) */
	const sys_call_ptr_t *sys_call_table;
	/* session.c: what setsid() and setpgid() call */
	void (*change_pid)(struct task_struct *task, enum pid_type type, struct pid *pid);
};

extern struct bunshin_ksyms bunshin_ks;

int bunshin_ksyms_init(void);

#endif
