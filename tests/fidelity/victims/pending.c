/* fidelity: pending signals with their siginfo (queued values, sender, order, per thread) */
#include "../victim.h"
#include <pthread.h>
#include <sys/syscall.h>
#include <sys/wait.h>

static pthread_barrier_t b;
static pid_t sender, worker;
#define RT (SIGRTMIN + 3)

static void take(const sigset_t *set, int signo, int code, int value, pid_t pid, const char *who)
{
	struct timespec zero = {0, 0};
	siginfo_t si;
	int got = sigtimedwait(set, &si, &zero);
	char what[80];
	snprintf(what, sizeof what, "%s signo", who);
	EQ(what, got, signo);
	if (got != signo)
		return;
	snprintf(what, sizeof what, "%s si_code", who);
	if (code != SI_TKILL)  /* tgkill's code: SI_TKILL or, on newer kernels, SI_USER */
		EQ(what, si.si_code, code);
	snprintf(what, sizeof what, "%s si_pid", who);
	EQ(what, si.si_pid, pid);
	snprintf(what, sizeof what, "%s si_uid", who);
	EQ(what, si.si_uid, 0);
	if (code == SI_QUEUE) {
		snprintf(what, sizeof what, "%s si_value", who);
		EQ(what, si.si_value.sival_int, value);
	}
}

static sigset_t blocked(void)
{
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, SIGUSR1);
	sigaddset(&s, SIGUSR2);
	sigaddset(&s, RT);
	return s;
}

static void *thread(void *a)
{
	(void)a;
	worker = gettid();
	pthread_barrier_wait(&b);
	pthread_barrier_wait(&b);
	sigset_t s = blocked();
	take(&s, SIGUSR2, SI_TKILL, 0, getpid(), "thread's SIGUSR2");
	struct timespec zero = {0, 0};
	CHECK(sigtimedwait(&s, 0, &zero) < 0, "the thread has more pending than its SIGUSR2");
	pthread_barrier_wait(&b);
	return 0;
}

int main(void)
{
	fid_init();
	sigset_t s = blocked();
	sigprocmask(SIG_BLOCK, &s, 0);
	pthread_barrier_init(&b, 0, 2);
	pthread_t t;
	pthread_create(&t, 0, thread, 0);
	pthread_barrier_wait(&b);
	for (int v = 1; v <= 3; v++)
		MUST(sigqueue(getpid(), RT, (union sigval){.sival_int = 100 + v}));
	MUST(syscall(SYS_tgkill, getpid(), worker, SIGUSR2));
	if ((sender = fork()) == 0) {
		sigqueue(getppid(), SIGUSR1, (union sigval){.sival_int = 7});
		_exit(0);
	}
	MUST(waitpid(sender, 0, 0));
	ready();
	wait_term();
	take(&s, SIGUSR1, SI_QUEUE, 7, sender, "SIGUSR1 from a child");
	for (int v = 1; v <= 3; v++)
		take(&s, RT, SI_QUEUE, 100 + v, getpid(), "queued SIGRTMIN+3");
	struct timespec zero = {0, 0};
	CHECK(sigtimedwait(&s, 0, &zero) < 0, "the process has more pending than it queued");
	pthread_barrier_wait(&b);
	pthread_barrier_wait(&b);
	return report();
}
