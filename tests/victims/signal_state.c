/* Per-thread signal state a fork must carry, set in three threads and checked by each thread
 * itself once the process gets SIGTERM: comm, alternate signal stack (and a handler running
 * on it), rseq registration (the kernel updates cpu_id; registering again says EBUSY), signal
 * mask, pending signals with their siginfo (per-thread and shared queues, real-time signals
 * queued several times, one from another process, a SIGCHLD), and a POSIX timer that signals
 * one thread (SIGEV_THREAD_ID). Each thread writes /tmp/r-N; /tmp/done once all have.
 * Run it with GLIBC_TUNABLES=glibc.pthread.rseq=0: it registers rseq itself. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <linux/rseq.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>

#define NT 3
#ifndef SS_AUTODISARM
#define SS_AUTODISARM (1U << 31)
#endif
#define SIGQ_MAIN 0x53053053
static const char *names[NT] = {"sig-main", "sig-w1", "sig-w2"};
static char alt[NT][65536] __attribute__((aligned(64)));
static const size_t altsz[NT] = {24576, 16384, 32768};
static const int altflags[NT] = {0, SS_AUTODISARM, 0};
static struct rseq rs[NT] __attribute__((aligned(32)));
static pid_t tids[NT];
static volatile int go, on_alt[NT];
static volatile int timer_ok, timer_bad;
static pthread_barrier_t ready;
#define TSIG (SIGRTMIN + 6)

static int idx(void) { pid_t t = gettid(); for (int i = 0; i < NT; i++) if (tids[i] == t) return i; return -1; }
static void on_urg(int s) { int i = idx(); char here; on_alt[i] = &here >= alt[i] && &here < alt[i] + altsz[i]; }
static void on_timer(int s) { if (gettid() == tids[2]) timer_ok++; else timer_bad++; }

static sigset_t private_set(void) { sigset_t s; sigemptyset(&s); sigaddset(&s, SIGUSR2); sigaddset(&s, SIGRTMIN + 4); return s; }
static sigset_t shared_set(void) { sigset_t s; sigemptyset(&s); sigaddset(&s, SIGUSR1); sigaddset(&s, SIGRTMIN + 2);
	sigaddset(&s, SIGRTMIN + 5); sigaddset(&s, SIGRTMIN + 7); sigaddset(&s, SIGCHLD);
	return s; }

static void setup(int i)
{
	tids[i] = gettid();
	prctl(PR_SET_NAME, names[i]);
	stack_t ss = {alt[i] + 64 * i, altflags[i], altsz[i]};
	if (sigaltstack(&ss, 0)) perror("sigaltstack");
	if (syscall(SYS_rseq, &rs[i], sizeof rs[i], 0, SIGQ_MAIN + i)) perror("rseq");
	sigset_t m; sigemptyset(&m);
	int blocked[] = {SIGTERM, SIGUSR1, SIGUSR2, SIGCHLD, SIGRTMIN + 2, SIGRTMIN + 4, SIGRTMIN + 5, SIGRTMIN + 7};
	for (unsigned k = 0; k < sizeof blocked / sizeof *blocked; k++) sigaddset(&m, blocked[k]);
	if (i == 0) sigaddset(&m, SIGHUP);
	if (i == 1) sigaddset(&m, SIGWINCH); /* TSIG stays open in all: only the timer's aim picks w2 */
	pthread_sigmask(SIG_SETMASK, &m, 0);
}

static void drain(FILE *f, sigset_t set)
{
	struct timespec zero = {0, 0};
	siginfo_t si;
	while (sigtimedwait(&set, &si, &zero) > 0)
		fprintf(f, "  sig %d code %d pid %d uid %d value %d status %d\n", si.si_signo, si.si_code, si.si_pid,
			si.si_uid, si.si_code == SI_QUEUE ? si.si_value.sival_int : 0, si.si_signo == SIGCHLD ? si.si_status : 0);
}

static void verify(int i)
{
	char path[64], name[32] = "";
	snprintf(path, sizeof path, "/tmp/r-%d.tmp", i);
	FILE *f = fopen(path, "w");
	prctl(PR_GET_NAME, name);
	fprintf(f, "thread %d tid %d comm %s\n", i, gettid() - getpid(), name);
	stack_t ss; sigaltstack(0, &ss);
	fprintf(f, "altstack off %ld size %zu flags %d\n", ss.ss_sp ? (char *)ss.ss_sp - alt[0] : -1, ss.ss_size, ss.ss_flags);
	on_alt[i] = -1;
	pthread_kill(pthread_self(), SIGURG);
	fprintf(f, "handler on altstack %d\n", on_alt[i]);
	rs[i].cpu_id = (uint32_t)-2;
	for (int k = 0; k < 500 && rs[i].cpu_id == (uint32_t)-2; k++) usleep(2000);
	int cpu = sched_getcpu();
	long again = syscall(SYS_rseq, &rs[i], sizeof rs[i], 0, SIGQ_MAIN + i);
	fprintf(f, "rseq updated %d again %ld errno %s\n", (int)rs[i].cpu_id == cpu, again, again ? strerrorname_np(errno) : "-");
	sigset_t m, p; pthread_sigmask(SIG_SETMASK, 0, &m); sigpending(&p);
	unsigned long mb = 0, pb = 0;
	for (int s = 1; s < 65; s++) { if (sigismember(&m, s)) mb |= 1UL << (s - 1); if (sigismember(&p, s)) pb |= 1UL << (s - 1); }
	fprintf(f, "mask %016lx pending %016lx\n", mb, pb);
	char line[256];
	FILE *st = fopen("/proc/thread-self/status", "r");
	while (fgets(line, sizeof line, st))
		if ((!strncmp(line, "Sig", 3) && strncmp(line, "SigQ", 4)) || !strncmp(line, "ShdPnd", 6))
			fputs(line, f); /* SigQ: a count over all processes of the user */
	fclose(st);
	if (i == 2) {
		int before = timer_ok;
		usleep(300000);
		fprintf(f, "timer to this thread %d others %d\n", timer_ok > before, timer_bad);
	}
	fprintf(f, "private queue:\n");
	drain(f, private_set());
	if (i == 0) { fprintf(f, "shared queue:\n"); drain(f, shared_set()); }
	fclose(f);
	char fin[64]; snprintf(fin, sizeof fin, "/tmp/r-%d", i);
	rename(path, fin);
}

static void *worker(void *arg)
{
	int i = (int)(long)arg;
	setup(i);
	pthread_barrier_wait(&ready);
	while (!go) usleep(1000);
	verify(i);
	return 0;
}

int main(void)
{
	struct sigaction sa = {.sa_handler = on_urg, .sa_flags = SA_ONSTACK};
	sigaction(SIGURG, &sa, 0);
	struct sigaction st = {.sa_handler = on_timer, .sa_flags = SA_RESTART};
	sigaction(TSIG, &st, 0);
	signal(SIGPIPE, SIG_IGN);
	pthread_barrier_init(&ready, 0, NT);
	setup(0);
	pthread_t t[NT];
	for (long i = 1; i < NT; i++) pthread_create(&t[i], 0, worker, (void *)i);
	pthread_barrier_wait(&ready);
	union sigval v;
	v.sival_int = 11; sigqueue(getpid(), SIGRTMIN + 2, v);
	v.sival_int = 22; sigqueue(getpid(), SIGRTMIN + 2, v);
	kill(getpid(), SIGUSR1);
	tgkill(getpid(), tids[0], SIGUSR2);
	v.sival_int = 44; pthread_sigqueue(pthread_self(), SIGRTMIN + 4, v);
	pthread_kill(t[1], SIGUSR2);
	v.sival_int = 101; pthread_sigqueue(t[1], SIGRTMIN + 4, v);
	v.sival_int = 102; pthread_sigqueue(t[1], SIGRTMIN + 4, v);
	v.sival_int = 201; pthread_sigqueue(t[2], SIGRTMIN + 4, v);
	/* no room for a queue entry: pending without siginfo (taken as SI_USER from no one) */
	struct rlimit lim, none;
	getrlimit(RLIMIT_SIGPENDING, &lim);
	none = (struct rlimit){0, lim.rlim_max};
	setrlimit(RLIMIT_SIGPENDING, &none);
	kill(getpid(), SIGRTMIN + 7);
	setrlimit(RLIMIT_SIGPENDING, &lim);
	pid_t c = fork();
	if (!c) { v.sival_int = 77; sigqueue(getppid(), SIGRTMIN + 5, v); _exit(3); }
	waitpid(c, 0, 0);
	struct sigevent ev = {.sigev_notify = SIGEV_THREAD_ID, .sigev_signo = TSIG};
	ev._sigev_un._tid = tids[2];
	timer_t tm;
	if (timer_create(CLOCK_MONOTONIC, &ev, &tm)) perror("timer_create");
	struct itimerspec its = {{0, 20000000}, {0, 20000000}};
	timer_settime(tm, 0, &its, 0);
	fclose(fopen("/tmp/ready", "w"));
	sigset_t term; sigemptyset(&term); sigaddset(&term, SIGTERM);
	while (sigwaitinfo(&term, 0) != SIGTERM) /* EINTR: a fork's ptrace stops interrupt it */
		;
	go = 1;
	for (int i = 1; i < NT; i++) pthread_join(t[i], 0); /* they see the shared queue undrained */
	verify(0);
	fclose(fopen("/tmp/done", "w"));
	return 0;
}
