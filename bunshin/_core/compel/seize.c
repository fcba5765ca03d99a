/* Attaching to threads, stopping them, waiting for their stops, letting them go. */
#include <dirent.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/wait.h>

#include "internal.h"

#define LOG_PREFIX "seize: "

int bx_verbose;

void bx_set_verbose(int on) { bx_verbose = on; }

double bx_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static const char *const step_names[] = {
	[BX_STEP_NONE] = "none",	 [BX_STEP_SEIZE] = "seize",
	[BX_STEP_INTERRUPT] = "interrupt", [BX_STEP_WAIT] = "wait",
	[BX_STEP_STOP_ALL] = "stop_all", [BX_STEP_GETREGS] = "getregs",
	[BX_STEP_PREPARE] = "prepare",	 [BX_STEP_SETREGS] = "setregs",
	[BX_STEP_SYSCALL] = "syscall",	 [BX_STEP_PEEK] = "peek",
	[BX_STEP_POKE] = "poke",	 [BX_STEP_STATE] = "thread_state",
	[BX_STEP_PIDNS] = "pidns",	 [BX_STEP_CLONE] = "clone3",
	[BX_STEP_CHILD] = "child",	 [BX_STEP_SIGNALS] = "signals",
	[BX_STEP_CURE] = "cure",	 [BX_STEP_DETACH] = "detach",
	[BX_STEP_BATCH] = "batch",
};

const char *bx_step_name(int step)
{
	if (step < 0 || step >= (int)(sizeof step_names / sizeof step_names[0]))
		return "unknown";
	return step_names[step];
}

/* Several keys of /proc/TID/status from one read (a read costs about what an injection does):
 * out[i] gets the value of keys[i]. 0 once every key was found. */
int bx_status_fields(pid_t tid, int nkeys, const char *const keys[], char *const out[], size_t n)
{
	char path[64], line[512];
	snprintf(path, sizeof path, "/proc/%d/status", tid);
	FILE *f = fopen(path, "re");
	if (!f)
		return errno == ENOENT ? -ESRCH : -errno;
	int found = 0;
	while (found < nkeys && fgets(line, sizeof line, f)) {
		for (int i = 0; i < nkeys; i++) {
			size_t klen = strlen(keys[i]);
			if (strncmp(line, keys[i], klen) || line[klen] != ':')
				continue;
			char *v = line + klen + 1;
			v += strspn(v, " \t");
			v[strcspn(v, "\n")] = 0;
			snprintf(out[i], n, "%s", v);
			found++;
			break;
		}
	}
	fclose(f);
	return found == nkeys ? 0 : -ENOENT;
}

int bx_status_field(pid_t tid, const char *key, char *out, size_t n)
{
	return bx_status_fields(tid, 1, &key, &out, n);
}

/* A list of pids as NSpid and NStgid give it (the tracer's namespace first); returns how many. */
static int parse_pids(const char *s, pid_t *out, int max)
{
	int n = 0;
	for (char *end; n < max; s = end) {
		long v = strtol(s, &end, 10);
		if (end == s)
			break;
		out[n++] = (pid_t)v;
	}
	return n ? n : -EINVAL;
}

/* NSpid lists the pid from the tracer's namespace inwards; returns how many levels. */
int bx_read_nspid(pid_t tid, pid_t *out, int max)
{
	char buf[256];
	int ret = bx_status_field(tid, "NSpid", buf, sizeof buf);
	return ret ? ret : parse_pids(buf, out, max);
}

static pid_t own_ns_pid(pid_t tid)
{
	pid_t ns[32];
	int n = bx_read_nspid(tid, ns, 32);
	return n > 0 ? ns[n - 1] : n;
}

int bx_add_thread(struct bx_ctl *c, pid_t tid) { return bx_add_thread_as(c, tid, 0); }

/* vtid 0: read it from /proc (a file read costs about as much as an injection) */
int bx_add_thread_as(struct bx_ctl *c, pid_t tid, pid_t vtid)
{
	for (int i = 0; i < c->nthr; i++)
		if (c->thr[i].tid == tid)
			return i;
	if (c->nthr == c->cap) {
		int cap = c->cap ? c->cap * 2 : 8;
		struct bx_thread *t = realloc(c->thr, cap * sizeof *t);
		if (!t)
			return -ENOMEM;
		c->thr = t;
		c->cap = cap;
	}
	struct bx_thread *t = &c->thr[c->nthr];
	memset(t, 0, sizeof *t);
	t->tid = tid;
	t->vtid = vtid > 0 ? vtid : own_ns_pid(tid);
	return c->nthr++;
}

/* Reap threads (never the leader) that have exited; returns how many. */
static int reap_exited_threads(struct bx_ctl *c)
{
	int n = 0;
	for (int i = 0; i < c->nthr; i++) {
		siginfo_t si = {0};
		pid_t tid = c->thr[i].tid;
		if (tid != c->pid && !waitid(P_PID, tid, &si, WEXITED | __WALL | WNOHANG) &&
		    si.si_pid == tid) {
			c->thr[i].stopped = 0;
			n++;
		}
	}
	return n;
}

/* --- the bound of a wait ---------------------------------------------------------------
 * waitid has no timeout. A POSIX timer of the waiting thread's own signals it BX_WAIT_SIGNAL
 * (SIGEV_THREAD_ID) at the deadline, and since its handler is installed without SA_RESTART the
 * blocking waitid returns EINTR. The timer repeats after the deadline: a signal that lands just
 * before the waitid is entered (and so interrupts nothing) is followed by another. Arming and
 * disarming cost two system calls a wait, and the wait stays the kernel's own blocking one. */
static pthread_once_t alarm_once = PTHREAD_ONCE_INIT;
static pthread_key_t alarm_key; /* deletes a thread's timer as the thread exits */
static __thread timer_t alarm_timer;
static __thread int alarm_made;
#define ALARM_REPEAT_NS 10000000L

static void alarm_noop(int sig) { (void)sig; }

static void alarm_drop(void *id) { timer_delete((timer_t)((intptr_t)id - 1)); }

static void alarm_setup(void)
{
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = alarm_noop; /* no SA_RESTART: the interrupted waitid returns EINTR */
	sigemptyset(&sa.sa_mask);
	sigaction(BX_WAIT_SIGNAL, &sa, NULL);
	pthread_key_create(&alarm_key, alarm_drop);
}

static void set_alarm(int64_t ns)
{
	struct itimerspec it;
	memset(&it, 0, sizeof it);
	if (ns > 0) {
		it.it_value.tv_sec = ns / 1000000000;
		it.it_value.tv_nsec = ns % 1000000000;
		it.it_interval.tv_nsec = ALARM_REPEAT_NS;
	}
	timer_settime(alarm_timer, 0, &it, NULL);
}

static int arm_alarm(int64_t ns)
{
	if (!alarm_made) {
		pthread_once(&alarm_once, alarm_setup);
		struct sigevent ev;
		memset(&ev, 0, sizeof ev);
		ev.sigev_notify = SIGEV_THREAD_ID;
		ev.sigev_signo = BX_WAIT_SIGNAL;
		ev._sigev_un._tid = gettid();
		if (timer_create(CLOCK_MONOTONIC, &ev, &alarm_timer))
			return -errno;
		pthread_setspecific(alarm_key, (void *)((intptr_t)alarm_timer + 1)); /* ids start at 0 */
		sigset_t s;
		sigemptyset(&s);
		sigaddset(&s, BX_WAIT_SIGNAL);
		pthread_sigmask(SIG_UNBLOCK, &s, NULL);
		alarm_made = 1;
	}
	set_alarm(ns);
	return 0;
}

void bx_set_wait_timeout(struct bx_ctl *c, int64_t ns) { c->wait_ns = ns > 0 ? ns : 0; }

pid_t bx_overdue(const struct bx_ctl *c) { return c->overdue; }

/* Waits for the next report of thread tid: 0 and *status for a stop, -ESRCH once it is gone,
 * -ETIMEDOUT if none came by the deadline (0: none).
 *
 * Peek first (WNOWAIT), because an exit is not always ours to consume: reaping the leader
 * when we are also its real parent would steal the exit status from the code that started
 * it. Reaping a leader we merely trace hands it on to its parent, status intact.
 *
 * And a traced zombie thread waits for its tracer to reap it, while a leader is not reported
 * before all other threads are reaped: so for the leader of a multi-threaded tracee we poll,
 * reaping the others, or a dying tracee would block us forever. */
static int wait_report(struct bx_ctl *c, pid_t tid, int *status, double deadline, int poll)
{
	poll |= c->nthr > 1 && tid == c->pid;
	long ns = 2000;
	for (;;) {
		siginfo_t si = {0};
		if (waitid(P_PID, tid, &si, WEXITED | WSTOPPED | __WALL | WNOWAIT | (poll ? WNOHANG : 0))) {
			if (errno != EINTR)
				return errno == ECHILD ? -ESRCH : -errno;
			if (deadline && bx_now() >= deadline)
				return -ETIMEDOUT;
			continue;
		}
		if (si.si_pid == 0) {
			if (reap_exited_threads(c))
				continue;
			if (deadline < 0 || (deadline && bx_now() >= deadline))
				return -ETIMEDOUT;
			struct timespec ts = {0, ns};
			nanosleep(&ts, NULL);
			ns = ns < 1000000 ? ns * 2 : ns;
			continue;
		}
		int exited = si.si_code == CLD_EXITED || si.si_code == CLD_KILLED ||
			     si.si_code == CLD_DUMPED;
		if (exited && tid == c->pid && c->parent_is_us) {
			bx_log("%d is gone, left for its parent to reap", tid);
			return -ESRCH;
		}
		while (waitpid(tid, status, __WALL) < 0)
			if (errno != EINTR)
				return errno == ECHILD ? -ESRCH : -errno;
		if (exited) {
			bx_log("%d is gone (status 0x%x)", tid, *status);
			return -ESRCH;
		}
		return 0;
	}
}

int bx_wait_for(struct bx_ctl *c, pid_t tid, int *status, int64_t ns)
{
	int ret;
	if (ns == BX_WAIT_POLL) {
		ret = wait_report(c, tid, status, -1, 1);
	} else if (!ns) {
		ret = wait_report(c, tid, status, 0, 0);
	} else {
		if ((ret = arm_alarm(ns)))
			return ret;
		ret = wait_report(c, tid, status, bx_now() + ns * 1e-9, 0);
		set_alarm(0);
	}
	if (ret == -ETIMEDOUT) {
		c->overdue = tid;
		bx_log("%d: no report within %.3f s", tid, ns > 0 ? ns * 1e-9 : 0.0);
	}
	return ret;
}

int bx_wait(struct bx_ctl *c, pid_t tid, int *status) { return bx_wait_for(c, tid, status, c->wait_ns); }

int bx_stop_overdue(struct bx_ctl *c, pid_t tid, int resume)
{
	for (;;) {
		if (ptrace(PTRACE_INTERRUPT, tid, 0, 0))
			return errno == ESRCH ? -ESRCH : -errno;
		int st, ret = bx_wait(c, tid, &st);
		if (ret)
			return ret;
		int event = st >> 16, sig = WSTOPSIG(st);
		siginfo_t si;
		if (event == PTRACE_EVENT_STOP || (!event && sig == (SIGTRAP | 0x80)))
			return 0;
		/* the step's trap or the batch's int3 (a kernel-made SIGTRAP): stopped as well */
		if (!event && sig == SIGTRAP && !ptrace(PTRACE_GETSIGINFO, tid, 0, &si) &&
		    si.si_code > 0)
			return 0;
		if (!bx_fork_event(c, tid, st) && !event && (ret = bx_hold_signal(c, tid, sig)))
			return ret;
		if (ptrace(resume, tid, 0, 0))
			return -errno;
	}
}

/* Until thread i reports the stop PTRACE_INTERRUPT asked for. A signal that arrives first is
 * delivered as it would have been without us; new threads are recorded (TRACECLONE attached
 * them, they start stopped). */
static int wait_interrupt_stop(struct bx_ctl *c, int i, int64_t ns)
{
	pid_t tid = c->thr[i].tid;
	for (;;) {
		int st, ret = bx_wait_for(c, tid, &st, ns);
		if (ret)
			return ret;
		int event = st >> 16, sig = WSTOPSIG(st);
		if (event == PTRACE_EVENT_STOP)
			break;
		int deliver = 0;
		if (event == PTRACE_EVENT_CLONE) {
			unsigned long msg = 0;
			if (!ptrace(PTRACE_GETEVENTMSG, tid, 0, &msg) && bx_add_thread(c, msg) < 0)
				return -ENOMEM;
		} else if (!event && sig != (SIGTRAP | 0x80)) {
			deliver = sig;
		}
		/* any ptrace stop consumes a pending PTRACE_INTERRUPT: ask again */
		if (ptrace(PTRACE_CONT, tid, 0, deliver) || ptrace(PTRACE_INTERRUPT, tid, 0, 0))
			return -errno;
	}
	c->thr[i].stopped = 1;
	return bx_arch_get_regs(tid, &c->thr[i].regs);
}

/*
 * Whether seizes suspend the victim's seccomp filter (-1: not tried yet). With it, the calls
 * compel injects are not subject to the filter (a filter that kills on setns or pidfd_open
 * would otherwise kill a template process mid-fork), and neither are the fixups in a clone,
 * which is attached with its parent's options; the filter applies again after detach, and
 * clones keep it. CRIU seizes the same way. The kernel allows it to a tracer with
 * CAP_SYS_ADMIN that is not itself filtered, on kernels with CONFIG_CHECKPOINT_RESTORE;
 * elsewhere compel seizes without it (a filtered victim may then refuse or die of a call).
 */
static int suspend_seccomp = -1;

int bx_suspends_seccomp(void)
{
	return suspend_seccomp;
}

unsigned long bx_seize_opts(void)
{
	return BX_SEIZE_BASE | (suspend_seccomp > 0 ? PTRACE_O_SUSPEND_SECCOMP : 0);
}

static int seize_once(pid_t tid)
{
	if (suspend_seccomp < 0) {
		if (!ptrace(PTRACE_SEIZE, tid, 0, BX_SEIZE_BASE | PTRACE_O_SUSPEND_SECCOMP)) {
			suspend_seccomp = 1;
			return 0;
		}
		if (errno != EINVAL && errno != EPERM)
			return -1;
		if (ptrace(PTRACE_SEIZE, tid, 0, BX_SEIZE_BASE))
			return -1; /* EPERM from both: traced already, not the option's fault */
		suspend_seccomp = 0;
		bx_log("%d: seized without PTRACE_O_SUSPEND_SECCOMP", tid);
		return 0;
	}
	return ptrace(PTRACE_SEIZE, tid, 0, BX_SEIZE_OPTS) ? -1 : 0;
}

static int seize_thread(struct bx_ctl *c, pid_t tid)
{
	/* No PTRACE_O_EXITKILL: if the tracer dies, the kernel detaches and the victim lives. */
	if (seize_once(tid)) {
		int e = errno;
		if (e != EPERM)
			return -e;
		/* EPERM: a thread made by one we seized is attached to us already (TRACECLONE), or
		 * the thread is exiting, and then its status is gone or cut short */
		char tracer[32];
		int ret = bx_status_field(tid, "TracerPid", tracer, sizeof tracer);
		if (ret == -ESRCH || ret == -ENOENT)
			return -ESRCH;
		if (ret || atoi(tracer) != getpid())
			return -EPERM;
	}
	if (ptrace(PTRACE_INTERRUPT, tid, 0, 0))
		return -errno;
	return 0;
}

/* What a seize needs to know of a task, from one read of /proc/TID/status (a seize used to
 * make four). */
struct status_ids {
	pid_t tgid, ppid, vtgid, vtid; /* vtgid, vtid: in the task's own pid namespace */
	int levels;                    /* pid namespaces from the tracer's inwards */
};

static int read_ids(pid_t tid, struct status_ids *o)
{
	static const char *const keys[] = {"Tgid", "PPid", "NStgid", "NSpid"};
	char v[4][256];
	char *const out[] = {v[0], v[1], v[2], v[3]};
	pid_t ns[32];
	int ret = bx_status_fields(tid, 4, keys, out, sizeof v[0]);
	if (ret)
		return ret;
	o->tgid = (pid_t)atoi(v[0]);
	o->ppid = (pid_t)atoi(v[1]);
	if ((o->levels = parse_pids(v[2], ns, 32)) < 0)
		return o->levels;
	o->vtgid = ns[o->levels - 1];
	if ((ret = parse_pids(v[3], ns, 32)) < 0)
		return ret;
	o->vtid = ns[ret - 1];
	return 0;
}

/* Attach and ask for a stop, without waiting for it: a task frozen by the cgroup freezer stops
 * only once thawed, so the engine seizes the whole frozen tree first, then thaws, then waits. */
struct bx_ctl *bx_seize_begin(pid_t tid, int *err)
{
	struct status_ids ids;
	int ret = read_ids(tid, &ids);
	struct bx_ctl *c = NULL;
	if (ret)
		goto fail;
	ret = -ENOMEM;
	c = calloc(1, sizeof *c);
	if (!c)
		goto fail;
	c->pid = ids.tgid;
	c->vpid = ids.vtgid;
	c->nslevels = ids.levels;
	c->parent_is_us = ids.ppid == getpid();
	c->step = BX_STEP_SEIZE;
	if ((ret = bx_add_thread_as(c, tid, ids.vtid)) < 0)
		goto fail;
	if ((ret = seize_thread(c, tid)))
		goto fail;
	c->attached = 1;
	return c;
fail:
	if (c && c->attached)
		ptrace(PTRACE_DETACH, tid, 0, 0);
	free(c ? c->thr : NULL);
	free(c);
	*err = ret == -ENOENT ? -ESRCH : ret;
	return NULL;
}

/* Wait for the stop bx_seize_begin asked for; on failure the block is freed (detached), but
 * past the bound (-ETIMEDOUT), when it is kept for another try. */
int bx_seize_finish(struct bx_ctl *c)
{
	int ret;
	c->step = BX_STEP_WAIT;
	if ((ret = wait_interrupt_stop(c, 0, c->wait_ns))) {
		if (ret == -ETIMEDOUT)
			return ret;
		bx_free(c);
		return ret;
	}
	c->cur = c->thr[0].regs;
	c->step = BX_STEP_NONE;
	bx_log("seized %d (pid %d), ip %#lx, in syscall %d", c->thr[0].tid, c->pid, bx_arch_ip(&c->cur),
	       bx_arch_in_syscall(&c->cur));
	return 0;
}

struct bx_ctl *bx_seize(pid_t tid, int *err)
{
	struct bx_ctl *c = bx_seize_begin(tid, err);
	if (c && (*err = bx_seize_finish(c)))
		return NULL;
	return c;
}

int bx_seize_threads_begin(struct bx_ctl *c)
{
	char path[64];
	snprintf(path, sizeof path, "/proc/%d/task", c->pid);
	DIR *d = opendir(path);
	if (!d)
		return bx_fail(c, BX_STEP_STOP_ALL, errno == ENOENT ? -ESRCH : -errno);
	struct dirent *e;
	int ret = 0;
	while (!ret && (e = readdir(d))) {
		pid_t tid = atoi(e->d_name);
		int known = tid <= 0;
		for (int i = 0; !known && i < c->nthr; i++)
			known = c->thr[i].tid == tid;
		if (known)
			continue;
		int i = bx_add_thread(c, tid);
		if (i < 0) {
			ret = i;
			break;
		}
		if ((ret = seize_thread(c, tid)) == -ESRCH) { /* exited meanwhile */
			c->thr[i] = c->thr[--c->nthr];
			ret = 0;
		}
	}
	closedir(d);
	return ret ? bx_fail(c, BX_STEP_STOP_ALL, ret) : 0;
}

/* Seize every thread listed in /proc/PID/task until a pass finds none new: a thread not yet
 * stopped may create another; threads made by an already seized one arrive through TRACECLONE. */
int bx_stop_all_seized(struct bx_ctl *c)
{
	char path[64];
	snprintf(path, sizeof path, "/proc/%d/task", c->pid);
	for (int pass = 0;; pass++) {
		int found = 0;
		DIR *d = opendir(path);
		if (!d)
			return bx_fail(c, BX_STEP_STOP_ALL, errno == ENOENT ? -ESRCH : -errno);
		struct dirent *e;
		while ((e = readdir(d))) {
			pid_t tid = atoi(e->d_name);
			if (tid <= 0)
				continue;
			int known = 0;
			for (int i = 0; i < c->nthr; i++)
				known |= c->thr[i].tid == tid;
			if (known)
				continue;
			int i = bx_add_thread(c, tid);
			if (i < 0) {
				closedir(d);
				return bx_fail(c, BX_STEP_STOP_ALL, i);
			}
			int ret = seize_thread(c, tid);
			if (ret == -ESRCH) { /* exited meanwhile */
				c->thr[i] = c->thr[--c->nthr];
				continue;
			}
			if (ret) {
				closedir(d);
				return bx_fail(c, BX_STEP_STOP_ALL, ret);
			}
			found++;
		}
		closedir(d);
		/* threads seized (or auto-attached) but not yet seen stopped */
		for (int i = 1; i < c->nthr; i++) {
			if (c->thr[i].stopped)
				continue;
			int ret = wait_interrupt_stop(c, i, c->wait_ns);
			if (ret == -ESRCH && c->thr[i].tid != c->pid) {
				c->thr[i--] = c->thr[--c->nthr];
				continue;
			}
			if (ret)
				return bx_fail(c, BX_STEP_STOP_ALL, ret);
			found++;
		}
		if (!found)
			break;
	}
	bx_log("%d threads stopped", c->nthr);
	return 0;
}

int bx_detach(struct bx_ctl *c)
{
	int ret = 0, nlate = 0;
	if (!c->attached)
		return 0;
	if (!c->cured && !c->dead && c->thr[0].stopped && (ret = bx_cure_seized(c)))
		bx_log("cure failed (%d), detaching anyway", ret);
	/* a thread can be let go only from a ptrace stop: one asked for and not yet seen is
	 * collected if it has come, else the thread stays, late (new ones may join the list) */
	for (int i = 0; i < c->nthr; i++) {
		if (!c->thr[i].stopped && !c->dead) {
			int r = wait_interrupt_stop(c, i, BX_WAIT_POLL);
			if (r == -ETIMEDOUT) {
				c->thr[nlate++] = c->thr[i];
				continue;
			}
			if (r == -ESRCH)
				continue;
		}
		if (ptrace(PTRACE_DETACH, c->thr[i].tid, 0, 0) && errno != ESRCH && !ret)
			ret = bx_fail(c, BX_STEP_DETACH, -errno);
		c->thr[i].stopped = 0;
	}
	if (c->dead) /* reap traced zombies so none are left waiting for us */
		reap_exited_threads(c);
	c->nthr = nlate;
	if (nlate) {
		bx_log("%d: %d threads not stopped yet, still attached", c->pid, nlate);
		return ret;
	}
	c->attached = 0;
	bx_send_held(c);
	siginfo_t si;
	if (c->dead && !c->parent_is_us) /* hands the leader on to its parent */
		waitid(P_PID, c->pid, &si, WEXITED | __WALL | WNOHANG);
	return ret;
}

int bx_late(const struct bx_ctl *c, pid_t *out, int max)
{
	int n = 0;
	for (int i = 0; c->attached && i < c->nthr; i++)
		if (!c->thr[i].stopped) {
			if (n < max)
				out[n] = c->thr[i].tid;
			n++;
		}
	return n;
}

void bx_free(struct bx_ctl *c)
{
	if (!c)
		return;
	bx_detach(c);
	free(c->thr);
	free(c);
}

pid_t bx_pid(const struct bx_ctl *c) { return c->pid; }

int bx_take_owed_robust(struct bx_ctl *c, uint64_t *head, uint64_t *len)
{
	if (!c->owed_robust)
		return 0;
	*head = c->owed_robust;
	*len = c->owed_robust_len;
	c->owed_robust = 0;
	return 1;
}
pid_t bx_tid(const struct bx_ctl *c) { return c->thr[0].tid; }
pid_t bx_in_parent(const struct bx_ctl *c) { return c->in_parent; }
int bx_last_step(const struct bx_ctl *c) { return c->step; }
int bx_alive(const struct bx_ctl *c) { return !c->dead; }

int bx_threads(const struct bx_ctl *c, pid_t *out, int max)
{
	for (int i = 0; i < c->nthr && i < max; i++)
		out[i] = c->thr[i].tid;
	return c->nthr;
}
