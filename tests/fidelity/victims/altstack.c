/* fidelity: alternate signal stack of each thread (address, size, flags, a handler on it) */
#include "../victim.h"
#include <pthread.h>

#define NT 3
static char stacks[NT][65536];
static const size_t sizes[NT] = {24576, 16384, 40960};
static const int flags[NT] = {0, SS_AUTODISARM, 0};
static pthread_barrier_t up, go, done;
static volatile int on_alt[NT];
static __thread int me;

static void on_usr(int s) { char here; (void)s; on_alt[me] = &here >= stacks[me] && &here < stacks[me] + sizes[me]; }

static void check(void)
{
	stack_t got;
	char what[64];
	sigaltstack(0, &got);
	snprintf(what, sizeof what, "thread %d ss_sp offset", me);
	EQ(what, (char *)got.ss_sp - stacks[me], 64 * me);
	snprintf(what, sizeof what, "thread %d ss_size", me);
	EQ(what, got.ss_size, sizes[me]);
	snprintf(what, sizeof what, "thread %d ss_flags", me);
	EQ(what, got.ss_flags, flags[me]);
	raise(SIGUSR1);
	snprintf(what, sizeof what, "thread %d handler ran on its altstack", me);
	EQ(what, on_alt[me], 1);
}

static void set(void)
{
	stack_t ss = {stacks[me] + 64 * me, flags[me], sizes[me]};
	MUST(sigaltstack(&ss, 0));
}

static void *thread(void *arg)
{
	me = (int)(long)arg;
	set();
	pthread_barrier_wait(&up);
	pthread_barrier_wait(&go);
	check();
	pthread_barrier_wait(&done);
	return 0;
}

int main(void)
{
	fid_init();
	struct sigaction sa = {.sa_handler = on_usr, .sa_flags = SA_ONSTACK};
	sigaction(SIGUSR1, &sa, 0);
	pthread_barrier_init(&up, 0, NT);
	pthread_barrier_init(&go, 0, NT);
	pthread_barrier_init(&done, 0, NT);
	pthread_t t;
	for (long i = 1; i < NT; i++)
		pthread_create(&t, 0, thread, (void *)i);
	set();
	pthread_barrier_wait(&up);
	ready();
	wait_term();
	pthread_barrier_wait(&go);
	check();
	pthread_barrier_wait(&done);
	return report();
}
