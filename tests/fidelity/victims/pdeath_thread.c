/* fidelity: parent-death signals set by threads other than the main one (PR_SET_PDEATHSIG is a thread's) */
#include "../victim.h"
#include <sys/prctl.h>

#define NT 3
static pthread_barrier_t b;

/* The signal each thread sets: the main thread SIGUSR2, thread 1 SIGUSR1, thread 2 none. */
static int want(int i) { return i == 0 ? SIGUSR2 : i == 1 ? SIGUSR1 : 0; }

static void check(int i)
{
	int sig = -1;
	char what[64];
	prctl(PR_GET_PDEATHSIG, &sig);
	snprintf(what, sizeof what, "thread %d's PDEATHSIG", i);
	EQ(what, sig, want(i));
}

static void *thread(void *a)
{
	int i = (int)(long)a;
	if (want(i))
		prctl(PR_SET_PDEATHSIG, want(i));
	pthread_barrier_wait(&b);
	pthread_barrier_wait(&b);
	check(i);
	pthread_barrier_wait(&b);
	return 0;
}

int main(void)
{
	fid_init();
	pthread_barrier_init(&b, 0, NT);
	pthread_t t[NT];
	for (long i = 1; i < NT; i++)
		MUST(pthread_create(&t[i], 0, thread, (void *)i) ? -1 : 0);
	MUST(prctl(PR_SET_PDEATHSIG, want(0)));
	pthread_barrier_wait(&b);
	ready();
	wait_term();
	pthread_barrier_wait(&b);
	check(0);
	pthread_barrier_wait(&b);
	return report();
}
