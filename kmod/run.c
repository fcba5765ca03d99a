// SPDX-License-Identifier: GPL-2.0
/*
 * RUN: a list of system calls made by a stopped tracee itself, in the kernel, in one resume.
 *
 * The fork engine fixes every clone up with a dozen system calls run inside it (join the
 * child's namespaces, open its terminal, move descriptors).  Injected with ptrace that is a
 * stop for a scratch mapping, a write of its data, a stop for the batch and one to unmap it.
 * Here the ioctl queues the list on the task and resumes it (tracee.c); on its way back to
 * user mode the task maps the data, calls each system call's own entry point with the
 * arguments in a pt_regs of ours (its user registers are never touched), unmaps and stops
 * again.  Only calls that need nothing of the caller's registers are allowed.
 */
#define pr_fmt(fmt) "bunshin: run: " fmt

#include <linux/bunshin.h>
#include <linux/capability.h>
#include <linux/err.h>
#include <linux/mman.h>
#include <linux/mm.h>
#include <linux/ptrace.h>
#include <linux/sched/task_stack.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <asm/syscall.h>

#include "ksyms.h"
#include "refs.h"
#include "tracee.h"
#include "verbs.h"

static const u16 allowed[] = { BUNSHIN_RUN_SYSCALLS_X86_64 };

#define ARG_FLAGS (0x3fU | (0x3fU << 8))
#define KNOWN_FLAGS (ARG_FLAGS | BUNSHIN_RUN_OK_ANY)

struct run_req {
	struct bunshin_tracee_work tw;
	struct bunshin_run_call *calls;
	void *data;
	u32 n;
	u32 data_size;
	u32 ran;
};

static bool is_allowed(u32 nr)
{
	size_t i;

	for (i = 0; i < ARRAY_SIZE(allowed); i++)
		if (allowed[i] == nr)
			return true;
	return false;
}

/* Everything about one call that can be refused before the task is resumed. */
static int check_call(const struct bunshin_run_call *c, u32 index, u32 data_size)
{
	int i;

	if (c->pad || c->reserved[0] || c->reserved[1] || c->ret || (c->flags & ~KNOWN_FLAGS) ||
	    c->ok_errno >= MAX_ERRNO || !is_allowed(c->nr))
		return -EINVAL;
	for (i = 0; i < 6; i++) {
		bool result = c->flags & BUNSHIN_RUN_ARG_RESULT(i), data = c->flags & BUNSHIN_RUN_ARG_DATA(i);

		if (result && (data || c->args[i] >= index))
			return -EINVAL;
		if (data && c->args[i] >= data_size)
			return -EINVAL;
	}
	return 0;
}

static long call_one(struct run_req *req, const struct bunshin_run_call *c, unsigned long base)
{
	struct pt_regs regs = {};
	unsigned long a[6];
	int i;

	for (i = 0; i < 6; i++) {
		a[i] = c->args[i];
		if (c->flags & BUNSHIN_RUN_ARG_RESULT(i))
			a[i] = req->calls[a[i]].ret;
		else if (c->flags & BUNSHIN_RUN_ARG_DATA(i))
			a[i] += base;
	}
	regs.di = a[0];
	regs.si = a[1];
	regs.dx = a[2];
	regs.r10 = a[3];
	regs.r8 = a[4];
	regs.r9 = a[5];
	regs.orig_ax = c->nr;
	regs.ax = -ENOSYS;
	return bunshin_ks.sys_call_table[c->nr](&regs);
}

/* A signal came while the call slept: in a system call the kernel would deliver it and make
 * the call again; here there is no return to user mode to do that on, so the list stops
 * with the restart code and the caller makes the call again once the signal is taken. */
static bool restart_code(long ret)
{
	return ret == -ERESTARTSYS || ret == -ERESTARTNOINTR || ret == -ERESTARTNOHAND ||
	       ret == -ERESTART_RESTARTBLOCK;
}

static bool stops(const struct bunshin_run_call *c)
{
	if (restart_code(c->ret))
		return true;
	if (c->ret >= 0 || c->ret < -MAX_ERRNO || c->flags & BUNSHIN_RUN_OK_ANY)
		return false;
	return !c->ok_errno || -c->ret != c->ok_errno;
}

/* Runs in the tracee, on its way to user mode. */
static int run_in_task(struct bunshin_tracee_work *tw)
{
	struct run_req *req = container_of(tw, struct run_req, tw);
	unsigned long base = 0;
	u32 i;

	if (req->data_size) {
		base = vm_mmap(NULL, 0, req->data_size, PROT_READ | PROT_WRITE,
			       MAP_PRIVATE | MAP_ANONYMOUS, 0);
		if (IS_ERR_VALUE(base))
			return (int)base;
		if (copy_to_user((void __user *)base, req->data, req->data_size)) {
			vm_munmap(base, req->data_size);
			return -EFAULT;
		}
	}
	for (i = 0; i < req->n; i++) {
		req->calls[i].ret = call_one(req, &req->calls[i], base);
		req->ran++;
		if (stops(&req->calls[i]))
			break;
	}
	if (base)
		vm_munmap(base, req->data_size);
	return 0;
}

long bunshin_run(void __user *uarg)
{
	struct bunshin_run r;
	struct run_req req = { .ran = 0 };
	struct bunshin_run_call __user *uc;
	struct task_struct *task;
	long ret;
	u32 i;

	if (copy_from_user(&r, uarg, sizeof(r)))
		return -EFAULT;
	if (r.flags || r.done || r.resumed || r.pad || r.pid <= 0 ||
	    r.call_size != sizeof(struct bunshin_run_call) || !r.ncalls)
		return -EINVAL;
	for (i = 0; i < ARRAY_SIZE(r.reserved); i++)
		if (r.reserved[i])
			return -EINVAL;
	if (r.ncalls > BUNSHIN_RUN_MAX_CALLS || r.data_size > BUNSHIN_RUN_MAX_DATA)
		return -E2BIG;
	if (!capable(CAP_SYS_ADMIN) && !capable(CAP_CHECKPOINT_RESTORE))
		return -EPERM;

	uc = u64_to_user_ptr(r.calls_ptr);
	req.n = r.ncalls;
	req.calls = kvmalloc_array(r.ncalls, sizeof(*req.calls), GFP_KERNEL);
	if (!req.calls)
		return -ENOMEM;
	ret = -EFAULT;
	if (copy_from_user(req.calls, uc, r.ncalls * sizeof(*req.calls)))
		goto free_calls;
	for (i = 0; i < r.ncalls; i++) {
		ret = check_call(&req.calls[i], i, r.data_size);
		if (ret)
			goto free_calls;
	}
	req.data_size = r.data_size;
	if (r.data_size) {
		req.data = memdup_user(u64_to_user_ptr(r.data_ptr), r.data_size);
		if (IS_ERR(req.data)) {
			ret = PTR_ERR(req.data);
			req.data = NULL;
			goto free_calls;
		}
	}

	ret = -ESRCH;
	task = bunshin_get_task(r.pid);
	if (!task)
		goto free_data;
	ret = bunshin_tracee_check(task);
	if (!ret && !user_64bit_mode(task_pt_regs(task)))
		ret = -EINVAL;
	if (!ret) {
		req.tw.fn = run_in_task;
		ret = bunshin_tracee_run(task, &req.tw);
		r.resumed = req.tw.resumed;
	}
	bunshin_put_task(task);

	r.done = req.ran;
	for (i = 0; i < req.ran; i++)
		if (put_user(req.calls[i].ret, &uc[i].ret) && !ret)
			ret = -EFAULT;
	if (copy_to_user(uarg, &r, sizeof(r)) && !ret)
		ret = -EFAULT;
free_data:
	kfree(req.data);
free_calls:
	kvfree(req.calls);
	return ret;
}
