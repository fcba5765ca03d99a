/* Victims of a state each thread has its own of: NT threads (thread 0 the main one) each set
 * theirs up with setup(i), which the victim defines, before each_thread_start() returns; on
 * SIGTERM each_thread_check() has every thread check its own with check(i) at once, and
 * returns once all have. */
#include "victim.h"

#define NT 3

static void setup(int i);
static void check(int i);

static pthread_barrier_t each_thread_b;

static void *each_thread(void *a)
{
	int i = (int)(long)a;
	setup(i);
	pthread_barrier_wait(&each_thread_b);  /* all set up */
	pthread_barrier_wait(&each_thread_b);  /* SIGTERM came */
	check(i);
	pthread_barrier_wait(&each_thread_b);
	return 0;
}

static void each_thread_start(void)
{
	pthread_t t;
	pthread_barrier_init(&each_thread_b, 0, NT);
	for (long i = 1; i < NT; i++)
		MUST(pthread_create(&t, 0, each_thread, (void *)i) ? -1 : 0);
	setup(0);
	pthread_barrier_wait(&each_thread_b);
}

static void each_thread_check(void)
{
	pthread_barrier_wait(&each_thread_b);
	check(0);
	pthread_barrier_wait(&each_thread_b);
}
