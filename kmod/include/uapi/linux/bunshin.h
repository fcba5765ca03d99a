/* SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note */
/*
 * /dev/bunshin user-space ABI.
 *
 * Rules that keep this header stable: every struct is passed by value to
 * _IOWR() (never a pointer type), every field has a fixed width and says
 * whether it is read (in), written (out) or both, padding is explicit and
 * must be zero, and reserved fields must be zero on input and are zeroed on
 * output.  New behaviour gets a new ioctl number and a feature bit; an
 * existing ioctl never changes meaning.  User pointers travel as __u64.
 */
#ifndef _UAPI_LINUX_BUNSHIN_H
#define _UAPI_LINUX_BUNSHIN_H

#include <linux/ioctl.h>
#include <linux/types.h>

#define BUNSHIN_ABI_VERSION 1
#define BUNSHIN_IOC_MAGIC 'B'

/* module_version in struct bunshin_version */
#define BUNSHIN_VERSION_CODE(major, minor, patch) \
	(((major) << 16) | ((minor) << 8) | (patch))

/* Feature bit n is set when the module serves ioctl number n. */
#define BUNSHIN_FEATURE(nr) (1ULL << (nr))

/*
 * Ioctl numbers: 0 GET_VERSION, 1 SHARE_STATS, 2 REPARENT, 3 FORK,
 * 4 GROUP_STATS, 5 RUN, 6 JOIN_SESSION.
 */
#define BUNSHIN_NR_GET_VERSION 0
#define BUNSHIN_NR_SHARE_STATS 1
#define BUNSHIN_NR_REPARENT 2
#define BUNSHIN_NR_FORK 3
#define BUNSHIN_NR_GROUP_STATS 4
#define BUNSHIN_NR_RUN 5
#define BUNSHIN_NR_JOIN_SESSION 6

struct bunshin_version {
	__u32 abi_version;	/* out: BUNSHIN_ABI_VERSION of the module */
	__u32 module_version;	/* out: BUNSHIN_VERSION_CODE() of the module */
	__u64 features;		/* out: BUNSHIN_FEATURE(nr) for each verb served */
	__u64 reserved[6];	/* in: must be 0; out: 0 */
};

#define BUNSHIN_IOC_GET_VERSION \
	_IOWR(BUNSHIN_IOC_MAGIC, BUNSHIN_NR_GET_VERSION, struct bunshin_version)

/*
 * SHARE_STATS: how much physical memory a set of processes shares.
 *
 * pids are read in the caller's pid namespace.  Each pid's address space
 * (mm) is walked in turn under its mmap read lock; pids that share an mm
 * (threads, CLONE_VM) count as one member of the set.  The walks are not
 * one atomic snapshot: stop the set (SIGSTOP, cgroup freezer) for an exact
 * answer.
 *
 * What is counted: every present page-table entry of every VMA, in 4 KiB
 * pages - anonymous and file-backed, private and shared; a PMD-mapped
 * transparent huge page counts as 512 pages and a hugetlb page as its
 * size / 4 KiB.  Not counted: the shared zero page and the huge zero page,
 * entries that are not present (swapped out, migrating, never faulted),
 * and VM_PFNMAP mappings such as [vvar], which have no struct page.  This
 * is exactly the set of entries that /proc/PID/pagemap reports present,
 * minus the PFNs /proc/kpageflags marks ZERO_PAGE.
 *
 * A physical page belongs to the set's members that map it; membership is
 * restricted to the set (unlike /proc/kpagecount, which counts every
 * mapper in the system).
 *
 * Permission: CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE in the initial user
 * namespace, and PTRACE_MODE_READ_FSCREDS access to every pid.
 *
 * Errors: EINVAL nonzero flags/pad/reserved, wrong stats_size, npids 0, a
 * pid <= 0; E2BIG npids > BUNSHIN_SHARE_STATS_MAX_PIDS; EFAULT bad
 * pointers; ESRCH a pid that does not exist or has no mm (exited, zombie,
 * kernel thread); EPERM capability or ptrace check failed; EINTR fatal
 * signal; ENOMEM.
 */
#define BUNSHIN_SHARE_STATS_MAX_PIDS 4096

struct bunshin_pid_stats {
	__s32 pid;		/* out: pids[i] (a pid_t) */
	__u32 mm_slot;		/* out: lowest j with pids[j] in the same mm */
	__u64 mapped_pages;	/* out: counted page-table entries of the mm */
	__u64 shared_pages;	/* out: distinct pages also mapped by another
				 *	member of the set */
	__u64 unique_pages;	/* out: distinct pages no other member maps */
	__u64 reserved[4];	/* out: 0 */
};

/*
 * mapped_pages counts entries, so a page the mm maps at two addresses counts
 * twice there and once in shared_pages or unique_pages.
 */
struct bunshin_share_stats {
	__u64 pids_ptr;		/* in: user address of __s32 pids[npids] */
	__u64 stats_ptr;	/* in: user address of struct bunshin_pid_stats
				 *	[npids]; the array is written */
	__u32 npids;		/* in: 1..BUNSHIN_SHARE_STATS_MAX_PIDS */
	__u32 stats_size;	/* in: sizeof(struct bunshin_pid_stats) */
	__u32 flags;		/* in: must be 0 */
	__u32 nmms;		/* out: distinct mms among the pids */
	__u64 shared_pages;	/* out: distinct pages mapped by >= 2 members */
	__u64 total_pages;	/* out: distinct pages mapped by >= 1 member */
	__u64 reserved[4];	/* in: must be 0; out: 0 */
};

#define BUNSHIN_IOC_SHARE_STATS \
	_IOWR(BUNSHIN_IOC_MAGIC, BUNSHIN_NR_SHARE_STATS, struct bunshin_share_stats)

/*
 * REPARENT: make @new_parent the parent of @pid, as if @new_parent had forked
 * it.  A fork made by injection in user space can give a clone the right PID
 * but not the right parent; this makes the process tree exact, so getppid(),
 * wait() and SIGCHLD behave in the clone as in the original.
 *
 * Both pids are read in the caller's pid namespace and must be thread-group
 * leaders in one pid namespace; @pid moves with all its threads.  Refused:
 * EINVAL nonzero flags/pad/reserved, pid == new_parent, or new_parent below
 * pid in the tree (a cycle); ESRCH a pid that does not exist or is exiting
 * (zombies included); EXDEV the two are in different pid namespaces; EPERM
 * no CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE, or no PTRACE_MODE_ATTACH access
 * to either task; EBUSY @pid is ptraced and flags lacks
 * BUNSHIN_REPARENT_TRACED, or that flag is set and the calling thread is not
 * @pid's tracer.
 *
 * BUNSHIN_REPARENT_TRACED (module 0.2.0 and later): @pid is traced by the
 * calling thread, typically a clone made by injection that has not run yet.
 * Only its real parent moves; the caller stays its tracer, and when it
 * detaches @new_parent becomes its parent, so the clone never runs under a
 * wrong parent.  Threads traced by another tracer keep that tracer too.
 */
#define BUNSHIN_REPARENT_TRACED (1U << 0)

struct bunshin_reparent {
	__s32 pid;		/* in: the task to move (a pid_t) */
	__s32 new_parent;	/* in: its new parent (a pid_t) */
	__u32 flags;		/* in: 0 or BUNSHIN_REPARENT_TRACED */
	__u32 pad;		/* in: must be 0 */
	__s32 old_parent;	/* out: the parent it had (caller's pid ns; 0 if not visible) */
	__u32 pad2;		/* out: 0 */
	__u64 reserved[4];	/* in: must be 0; out: 0 */
};

#define BUNSHIN_IOC_REPARENT \
	_IOWR(BUNSHIN_IOC_MAGIC, BUNSHIN_NR_REPARENT, struct bunshin_reparent)

/*
 * GROUP_STATS (module 0.2.0 and later): SHARE_STATS where the members of the
 * set are groups of pids (say, the processes of one workspace each) rather
 * than single mms.  groups[i] names the group of pids[i]; a page mapped by
 * several mms of one group is one page of that group and counts as shared
 * only when another group maps it too.  Counting rules, permissions and
 * errors are those of SHARE_STATS, plus EINVAL when ngroups is 0 or larger
 * than npids, a group index is >= ngroups, or one mm (two threads, CLONE_VM)
 * appears in two groups.  A group with no pids reads as zeros.
 */
struct bunshin_group_usage {
	__u64 mapped_pages;	/* out: counted entries of the group's distinct mms */
	__u64 distinct_pages;	/* out: distinct pages the group maps */
	__u64 shared_pages;	/* out: of those, the pages another group maps */
	__u32 nmms;		/* out: distinct mms in the group */
	__u32 pad;		/* out: 0 */
	__u64 reserved[4];	/* out: 0 */
};

struct bunshin_group_stats {
	__u64 pids_ptr;		/* in: user address of __s32 pids[npids] */
	__u64 groups_ptr;	/* in: user address of __u32 groups[npids] */
	__u64 stats_ptr;	/* in: user address of struct bunshin_group_usage
				 *	[ngroups]; the array is written */
	__u32 npids;		/* in: 1..BUNSHIN_SHARE_STATS_MAX_PIDS */
	__u32 ngroups;		/* in: 1..npids */
	__u32 stats_size;	/* in: sizeof(struct bunshin_group_usage) */
	__u32 flags;		/* in: must be 0 */
	__u64 shared_pages;	/* out: distinct pages mapped by >= 2 groups */
	__u64 total_pages;	/* out: distinct pages mapped by >= 1 group */
	__u32 nmms;		/* out: distinct mms among the pids */
	__u32 pad;		/* in: must be 0; out: 0 */
	__u64 reserved[4];	/* in: must be 0; out: 0 */
};

#define BUNSHIN_IOC_GROUP_STATS \
	_IOWR(BUNSHIN_IOC_MAGIC, BUNSHIN_NR_GROUP_STATS, struct bunshin_group_stats)

/*
 * FORK (module 0.3.0 and later): clone @pid in the kernel, @nchildren times,
 * each child into a chosen pid namespace with a chosen pid and parent.
 *
 * @pid (caller's pid namespace) is a thread the calling thread has seized
 * (PTRACE_SEIZE) and that sits in a ptrace stop.  The module resumes it; on
 * its way back to user mode it makes the children itself (a fork() of
 * itself: memory copy-on-write, descriptors, handlers, blocked signals,
 * registers; fork()'s return value is not changed to 0) and then stops in a
 * PTRACE_EVENT_STOP the caller must wait for, as after PTRACE_INTERRUPT.  It
 * runs no user code in between.  Each child comes out traced by the caller
 * and stopped in its first PTRACE_EVENT_STOP, before any user code; it has
 * @pid's namespaces except that its pid (and its own children's) come from
 * its pid namespace, its parent is @parent, its exit signal SIGCHLD, and it
 * keeps @pid's robust futex list.  With @child_tid nonzero each child stores
 * its own tid there (CLONE_CHILD_SETTID), in the child's namespace.
 *
 * Per child: @pidns_pid names a task (caller's namespace) whose pid namespace
 * the child joins, which must be @pid's own or below it (0: @pid's own);
 * @tid is the child's pid in it (0: any free pid); @parent (caller's pid
 * namespace) a thread-group leader in that namespace (0: its init).  A
 * parent that exits before the child is made leaves it to that init.
 *
 * Errors: EINVAL unknown flags, nonzero done/resumed/reserved or child pid, wrong
 * child_size, nchildren 0; E2BIG more than BUNSHIN_FORK_MAX_CHILDREN; EFAULT
 * bad pointers; ESRCH a task that does not exist or exits; EBUSY @pid not
 * seized by the calling thread or not in a ptrace stop; EXDEV a namespace
 * not below @pid's, or a parent outside its child's namespace; EPERM no
 * CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE, no PTRACE_MODE_ATTACH access to a
 * parent, or @pid may not choose pids in that namespace (copy_process);
 * EEXIST a @tid in use; EAGAIN @pid has an unblocked signal pending (it would
 * stop for it first: let it take the signal, then call again) or one came,
 * or a freezer trap, while it was cloning itself; ETIMEDOUT it
 * did not reach the work within 2 s (module parameter fork_timeout_ms);
 * EINTR the caller was killed meanwhile;
 * and copy_process()'s own errors (ENOMEM, EAGAIN at RLIMIT_NPROC...).  On
 * error @done says how many children were made (their @pid filled in, the
 * caller disposes of them) and @pid, when @resumed says it was resumed,
 * stops again in a PTRACE_EVENT_STOP, possibly after a signal stop.
 *
 * Flags (module 0.5.0 and later; older modules refuse any with EINVAL):
 * BUNSHIN_FORK_IN_PARENT makes each child in its parent's world instead of
 * @pid's: the parent's namespaces (mount, network, IPC, UTS, cgroup, time:
 * its nsproxy, whose pid_ns_for_children must be the child's pid namespace,
 * else EXDEV), the parent's root and working directory (with @pid's umask),
 * and the parent's cgroups in every hierarchy (cgroup_attach_task_all()).
 * That is what setns() into the parent's namespaces, chdir() and a write
 * to cgroup.procs would do afterwards, without running the child; it needs
 * CAP_SYS_ADMIN (CAP_CHECKPOINT_RESTORE alone: EPERM).  A child
 * that could not join the cgroups is made and stopped anyway: the call
 * fails with that error and counts it in @done.
 */
#define BUNSHIN_FORK_MAX_CHILDREN 64
#define BUNSHIN_FORK_IN_PARENT (1U << 0)

struct bunshin_fork_child {
	__s32 pidns_pid;	/* in: a task in the child's pid namespace, 0: @pid's */
	__s32 tid;		/* in: the child's pid there, 0: any */
	__s32 parent;		/* in: its parent (a pid_t), 0: that namespace's init */
	__s32 pid;		/* in: must be 0; out: the child (caller's namespace) */
	__u64 reserved[2];	/* in: must be 0 */
};

struct bunshin_fork {
	__s32 pid;		/* in: the thread to clone (a pid_t) */
	__u32 nchildren;	/* in: 1..BUNSHIN_FORK_MAX_CHILDREN */
	__u64 children_ptr;	/* in: user address of struct bunshin_fork_child
				 *	[nchildren]; each pid is written */
	__u32 child_size;	/* in: sizeof(struct bunshin_fork_child) */
	__u32 flags;		/* in: BUNSHIN_FORK_IN_PARENT or 0 */
	__u64 child_tid;	/* in: address in @pid's memory, 0: none */
	__u32 done;		/* in: must be 0; out: children made */
	__u32 resumed;		/* in: must be 0; out: 1 once @pid was resumed:
				 *	it stops again, wait for it (errors too) */
	__u64 reserved[4];	/* in: must be 0 */
};

#define BUNSHIN_IOC_FORK \
	_IOWR(BUNSHIN_IOC_MAGIC, BUNSHIN_NR_FORK, struct bunshin_fork)

/*
 * RUN (module 0.4.0 and later): run a list of system calls in a stopped
 * tracee, in its own context, in one resume: what a batch injected with
 * ptrace does, without the round trips for its scratch memory, its table and
 * its results.
 *
 * @pid (caller's pid namespace) is a thread the calling thread has seized and
 * that sits in a ptrace stop, as for FORK.  The module resumes it; on its way
 * back to user mode it maps @data_size bytes of fresh anonymous memory, copies
 * the bytes at @data_ptr there, makes the calls in order as if it made them
 * itself (its credentials, namespaces, descriptors; seccomp filters, syscall
 * tracing and audit do not apply), unmaps the memory and stops in a
 * PTRACE_EVENT_STOP the caller must wait for.  It runs no user code and its
 * registers are not changed.
 *
 * Per call: @nr, one of BUNSHIN_RUN_SYSCALLS_X86_64; @args, of which
 * BUNSHIN_RUN_ARG_RESULT(i) makes args[i] the index of an earlier call whose
 * result it becomes, and BUNSHIN_RUN_ARG_DATA(i) an offset into the data whose
 * address there it becomes.  A call that fails (-4095..-1) stops the list
 * unless it has BUNSHIN_RUN_OK_ANY or that errno in @ok_errno; @done says how
 * many ran, each one's @ret its raw result.  A call a signal interrupted, which
 * a system call would make again once the signal is delivered, stops the list
 * too, with the kernel's restart code as @ret (-512 to -516: ERESTARTSYS,
 * ERESTARTNOINTR, ERESTARTNOHAND, ERESTART_RESTARTBLOCK): make it again once
 * the tracee has taken the signal.  The ioctl itself succeeds then: the results
 * tell.  The caller waits for the calls (a blocking one holds it): RUN is for
 * calls that do not wait for another process.
 *
 * Errors: EINVAL nonzero flags/pad/done/resumed/reserved, wrong call_size,
 * ncalls 0, a call number not in the list, a result that is not an earlier
 * call's, a data offset past @data_size, unknown call flags, a 32-bit task;
 * E2BIG ncalls > BUNSHIN_RUN_MAX_CALLS or data_size > BUNSHIN_RUN_MAX_DATA;
 * EFAULT bad pointers, or the data could not be copied in; ESRCH, EBUSY,
 * EAGAIN, ETIMEDOUT, EINTR and EPERM as for FORK; ENOMEM no room for the data.
 * Once @resumed says @pid was resumed it stops again, errors too: wait for it.
 */
#define BUNSHIN_RUN_MAX_CALLS 64
#define BUNSHIN_RUN_MAX_DATA 16384

/* close lseek ioctl fcntl dup3 chdir setsid setpgid openat pipe2 setns
 * pidfd_open pidfd_getfd getpid set_tid_address set_robust_list ftruncate
 * memfd_create getitimer setitimer timer_create timer_settime timer_gettime
 * timer_delete signalfd4 inotify_init1 inotify_add_watch inotify_rm_watch
 * eventfd2 timerfd_create timerfd_settime epoll_create1 epoll_ctl socket
 * socketpair bind listen shutdown unlinkat rt_sigaction tee
 * sched_setaffinity: calls on
 * descriptors, namespaces and process attributes that need nothing of the
 * caller's registers. */
#define BUNSHIN_RUN_SYSCALLS_X86_64 \
	3, 8, 16, 72, 292, 80, 112, 109, 257, 293, 308, 434, 438, 39, 218, 273, \
	77, 319, 36, 38, 222, 223, 224, 226, 289, 294, 254, 255, 290, 283, 286, \
	291, 233, 41, 53, 49, 50, 48, 263, 13, 276, 203

#define BUNSHIN_RUN_ARG_RESULT(i) (1U << (i))
#define BUNSHIN_RUN_ARG_DATA(i) (1U << (8 + (i)))
#define BUNSHIN_RUN_OK_ANY (1U << 16)

struct bunshin_run_call {
	__u32 nr;		/* in: system call number */
	__u32 flags;		/* in: BUNSHIN_RUN_ARG_*(i), BUNSHIN_RUN_OK_ANY */
	__u32 ok_errno;		/* in: 0, or one errno that does not stop the list */
	__u32 pad;		/* in: must be 0 */
	__u64 args[6];		/* in */
	__s64 ret;		/* in: must be 0; out: the raw result, for the calls that ran */
	__u64 reserved[2];	/* in: must be 0 */
};

struct bunshin_run {
	__s32 pid;		/* in: the thread to run them (a pid_t) */
	__u32 ncalls;		/* in: 1..BUNSHIN_RUN_MAX_CALLS */
	__u64 calls_ptr;	/* in: user address of struct bunshin_run_call
				 *	[ncalls]; each ret is written */
	__u64 data_ptr;		/* in: user address of data_size bytes */
	__u32 data_size;	/* in: 0..BUNSHIN_RUN_MAX_DATA */
	__u32 call_size;	/* in: sizeof(struct bunshin_run_call) */
	__u32 flags;		/* in: must be 0 */
	__u32 done;		/* in: must be 0; out: calls that ran */
	__u32 resumed;		/* in: must be 0; out: 1 once @pid was resumed */
	__u32 pad;		/* in: must be 0 */
	__u64 reserved[4];	/* in: must be 0 */
};

#define BUNSHIN_IOC_RUN \
	_IOWR(BUNSHIN_IOC_MAGIC, BUNSHIN_NR_RUN, struct bunshin_run)

/*
 * JOIN_SESSION (module 0.4.0 and later): put @pid in the session of
 * @session_of and the process group of @pgrp_of (@pid itself: a group of its
 * own), with that session's controlling terminal, as if it had been forked
 * inside them.  A clone made by FORK or by injection keeps its template's
 * session and group, which lie outside the child's pid namespace (NSsid 0 in
 * it: no job control, and CRIU refuses to dump it); the fork engine moves each
 * clone into the sessions and groups of the clones of their leaders instead.
 *
 * The three pids are read in the caller's pid namespace and must be
 * thread-group leaders in one pid namespace; @pid must not lead a session, and
 * @pgrp_of (unless it is @pid) must be in @session_of's session.  Refused:
 * EINVAL nonzero flags/reserved, a pid <= 0, a thread that is not a
 * group leader, @pid a session leader, @pgrp_of in another session; ESRCH a pid
 * that does not exist or is exiting; EXDEV not one pid namespace; EPERM no
 * CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE, or no PTRACE_MODE_ATTACH access to
 * one of them.
 */
struct bunshin_join_session {
	__s32 pid;		/* in: the process to move (a pid_t) */
	__s32 session_of;	/* in: a process of the session it joins */
	__s32 pgrp_of;		/* in: a process of the group it joins, or @pid */
	__u32 flags;		/* in: must be 0 */
	__s32 old_sid;		/* out: its session before (caller's pid ns; 0 if not visible) */
	__s32 old_pgid;		/* out: its process group before (likewise) */
	__u64 reserved[4];	/* in: must be 0; out: 0 */
};

#define BUNSHIN_IOC_JOIN_SESSION \
	_IOWR(BUNSHIN_IOC_MAGIC, BUNSHIN_NR_JOIN_SESSION, struct bunshin_join_session)

#endif /* _UAPI_LINUX_BUNSHIN_H */
