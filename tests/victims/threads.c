/* threads: a multi-threaded victim. <n> threads count in counters[i] (odd ones spin, even ones
 * sleep 1 ms per count); one more thread keeps creating and joining short-lived threads, so
 * threads appear while a tracer is stopping them. The main thread sleeps.
 * usage: threads <n>; prints "ready <pid> <address of counters>". */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static volatile unsigned long counters[64];

static void *count(void *arg)
{
	long i = (long)arg;
	struct timespec ms = {0, 1000000};
	for (;;) {
		counters[i]++;
		if (i % 2 == 0)
			nanosleep(&ms, NULL);
	}
	return NULL;
}

static void *nothing(void *arg) { return arg; }

static void *churn(void *arg)
{
	for (;;) {
		pthread_t t;
		if (!pthread_create(&t, NULL, nothing, NULL))
			pthread_join(t, NULL);
	}
	return NULL;
}

int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 16;
	if (n > 64)
		n = 64;
	setvbuf(stdout, NULL, _IOLBF, 0);
	for (long i = 0; i < n; i++) {
		pthread_t t;
		pthread_create(&t, NULL, count, (void *)i);
	}
	pthread_t t;
	pthread_create(&t, NULL, churn, NULL);
	printf("ready %d %p\n", getpid(), (void *)counters);
	for (;;)
		pause();
}
