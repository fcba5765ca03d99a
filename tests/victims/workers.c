/* workers: a victim for recreating threads in a fork. Everything it shows is in `st`, read
 * from outside (a fork shares the parent's stdout, so nothing is printed after "ready").
 *   <n> counters: st.counters[i]++ and st.tids[i] = gettid() in a loop (even ones sleep 1 ms
 *     per count); they also block SIGUSR2, and counter 0 runs with a sigaltstack;
 *   a waiter: stores its tid in st.waiter_tid, waits on a condition variable, then stores its
 *     tid in st.woke_tid and exits;
 *   a napper: nanosleep 200 ms at a time, then st.naps++ and st.napper_tid = gettid().
 * Every thread but main blocks SIGUSR1; main takes it with sigwaitinfo: st.usr1++, broadcast
 * the condition, pthread_join the waiter, st.joined = 1.
 * usage: workers <n>; prints "ready <pid> <address of st>". */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define MAXN 64

static struct {
	/* all longs: the test reads the block as an array of 8-byte words */
	volatile long counters[MAXN];
	volatile long tids[MAXN];
	volatile long waiter_tid, woke_tid, napper_tid, naps, usr1, joined;
} st;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int go;

static void *count(void *arg)
{
	long i = (long)arg;
	struct timespec ms = {0, 1000000};
	sigset_t usr2;
	sigemptyset(&usr2);
	sigaddset(&usr2, SIGUSR2);
	pthread_sigmask(SIG_BLOCK, &usr2, NULL);
	if (i == 0) {
		stack_t ss = {malloc(1 << 16), 0, 1 << 16};
		sigaltstack(&ss, NULL);
	}
	for (;;) {
		st.counters[i]++;
		st.tids[i] = gettid();
		if (i % 2 == 0)
			nanosleep(&ms, NULL);
	}
	return NULL;
}

static void *wait_cond(void *arg)
{
	st.waiter_tid = gettid();
	pthread_mutex_lock(&mu);
	while (!go)
		pthread_cond_wait(&cv, &mu);
	pthread_mutex_unlock(&mu);
	st.woke_tid = gettid();
	return arg;
}

static void *nap(void *arg)
{
	for (;;) {
		struct timespec t = {0, 200000000};
		nanosleep(&t, NULL); /* EINTR or not, a nap ends */
		st.napper_tid = gettid();
		st.naps++;
	}
	return arg;
}

int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 16;
	if (n > MAXN)
		n = MAXN;
	sigset_t usr1;
	sigemptyset(&usr1);
	sigaddset(&usr1, SIGUSR1);
	pthread_sigmask(SIG_BLOCK, &usr1, NULL); /* inherited by every thread */
	pthread_t waiter, t;
	for (long i = 0; i < n; i++)
		pthread_create(&t, NULL, count, (void *)i);
	pthread_create(&waiter, NULL, wait_cond, NULL);
	pthread_create(&t, NULL, nap, NULL);
	while (!st.waiter_tid || !st.tids[n - 1])
		usleep(1000);
	setvbuf(stdout, NULL, _IOLBF, 0);
	printf("ready %d %p\n", getpid(), (void *)&st);
	for (;;) {
		if (sigwaitinfo(&usr1, NULL) != SIGUSR1)
			continue; /* EINTR: a tracer stopped us */
		st.usr1++;
		pthread_mutex_lock(&mu);
		go = 1;
		pthread_cond_broadcast(&cv);
		pthread_mutex_unlock(&mu);
		if (!st.joined && !pthread_join(waiter, NULL))
			st.joined = 1;
	}
}
