/* fidelity: threads (tids, names, signal masks, thread-local data, CPU affinity) */
#include "../victim.h"
#include <pthread.h>
#include <sched.h>
#include <sys/prctl.h>

#define NT 4
static pthread_barrier_t b;
static pid_t tids[NT];
static __thread long local;
static pthread_mutex_t one_at_a_time = PTHREAD_MUTEX_INITIALIZER;

static void check(int i)
{
	char what[64], path[64];
	snprintf(what, sizeof what, "thread %d tid", i);
	EQ(what, gettid(), tids[i]);
	snprintf(what, sizeof what, "thread %d local", i);
	EQ(what, local, 1000 + i);
	char name[16] = {0}, want[16];
	prctl(PR_GET_NAME, name);
	snprintf(want, sizeof want, "fid-t%d", i);
	snprintf(what, sizeof what, "thread %d name", i);
	STREQ(what, name, want);
	snprintf(path, sizeof path, "/proc/self/task/%d/comm", tids[i]);
	snprintf(what, sizeof what, "thread %d comm in /proc", i);
	CHECK(!strncmp(slurp(path), want, strlen(want)), "%s: %s", what, slurp(path));
	sigset_t m;
	pthread_sigmask(SIG_BLOCK, 0, &m);
	snprintf(what, sizeof what, "thread %d blocks SIGRTMIN+%d", i, i);
	EQ(what, sigismember(&m, SIGRTMIN + i), 1);
	snprintf(what, sizeof what, "thread %d blocks SIGRTMIN+%d", i, i + 1);
	EQ(what, sigismember(&m, SIGRTMIN + i + 1), 0);
	cpu_set_t cpus;
	sched_getaffinity(0, sizeof cpus, &cpus);
	snprintf(what, sizeof what, "thread %d affinity (cpu 0 only for thread 1)", i);
	EQ(what, i == 1 ? CPU_COUNT(&cpus) == 1 && CPU_ISSET(0, &cpus) : CPU_COUNT(&cpus) > 1 || sysconf(_SC_NPROCESSORS_ONLN) == 1, 1);
}

static void setup(int i)
{
	tids[i] = gettid();
	local = 1000 + i;
	char name[16];
	snprintf(name, sizeof name, "fid-t%d", i);
	prctl(PR_SET_NAME, name);
	sigset_t m;
	sigemptyset(&m);
	sigaddset(&m, SIGRTMIN + i);
	pthread_sigmask(SIG_BLOCK, &m, 0);
	if (i == 1) {
		cpu_set_t one;
		CPU_ZERO(&one);
		CPU_SET(0, &one);
		sched_setaffinity(0, sizeof one, &one);
	}
}

static void *thread(void *a)
{
	int i = (int)(long)a;
	setup(i);
	pthread_barrier_wait(&b);
	pthread_barrier_wait(&b);
	pthread_mutex_lock(&one_at_a_time);  /* slurp's buffer is one */
	check(i);
	pthread_mutex_unlock(&one_at_a_time);
	pthread_barrier_wait(&b);
	return 0;
}

int main(void)
{
	fid_init();
	pthread_barrier_init(&b, 0, NT);
	pthread_t t;
	for (long i = 1; i < NT; i++)
		pthread_create(&t, 0, thread, (void *)i);
	setup(0);
	pthread_barrier_wait(&b);
	ready();
	wait_term();
	pthread_barrier_wait(&b);
	pthread_mutex_lock(&one_at_a_time);
	check(0);
	pthread_mutex_unlock(&one_at_a_time);
	pthread_barrier_wait(&b);
	return report();
}
