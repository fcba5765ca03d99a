/* fidelity: POSIX timers aimed at one thread (SIGEV_THREAD_ID): time left, interval, target */
#include "../victim.h"
#include <pthread.h>
#include <sys/syscall.h>

#define SIG (SIGRTMIN + 2)
static pthread_barrier_t b;
static pid_t worker;
static timer_t tm;
static double armed;

static void *thread(void *a)
{
	(void)a;
	worker = gettid();
	pthread_barrier_wait(&b);
	pthread_barrier_wait(&b);               /* the main thread has checked the timer, re-armed it */
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, SIG);
	struct timespec wait = {2, 0};
	siginfo_t si;
	EQ("the thread takes the timer's signal", sigtimedwait(&s, &si, &wait), SIG);
	EQ("si_code", si.si_code, SI_TIMER);
	EQ("si_value", si.si_value.sival_int, 4242);
	pthread_barrier_wait(&b);
	return 0;
}

int main(void)
{
	fid_init();
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, SIG);
	sigprocmask(SIG_BLOCK, &s, 0);
	pthread_barrier_init(&b, 0, 2);
	pthread_t t;
	pthread_create(&t, 0, thread, 0);
	pthread_barrier_wait(&b);
	struct sigevent ev = {.sigev_notify = SIGEV_THREAD_ID, .sigev_signo = SIG,
	                      .sigev_value.sival_int = 4242, ._sigev_un._tid = worker};
	MUST(timer_create(CLOCK_MONOTONIC, &ev, &tm));
	struct itimerspec its = {.it_value = {60, 0}, .it_interval = {7, 500000000}};
	MUST(timer_settime(tm, 0, &its, 0));
	armed = now(CLOCK_MONOTONIC);
	ready();
	wait_term();
	struct itimerspec got;
	MUST(timer_gettime(tm, &got));
	NEAR("time left", secs(got.it_value), 60 - (now(CLOCK_MONOTONIC) - armed), 0.25);
	NEAR("interval", secs(got.it_interval), 7.5, 0.001);
	its = (struct itimerspec){.it_value = {0, 20000000}};
	MUST(timer_settime(tm, 0, &its, 0));
	pthread_barrier_wait(&b);
	pthread_barrier_wait(&b);
	struct timespec zero = {0, 0};
	CHECK(sigtimedwait(&s, 0, &zero) < 0, "the timer's signal reached the main thread too");
	return report();
}
