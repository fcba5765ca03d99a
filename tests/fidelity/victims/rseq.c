/* fidelity: rseq registration of each thread (glibc's own area, cpu_id kept up to date) */
#include "../victim.h"
#include <pthread.h>
#include <sched.h>
#include <sys/rseq.h>
#include <sys/syscall.h>

static pthread_barrier_t b;

static void check(const char *who)
{
	struct rseq *rs = (struct rseq *)((char *)__builtin_thread_pointer() + __rseq_offset);
	char what[64];
	snprintf(what, sizeof what, "%s registered again (EBUSY: still registered)", who);
	int busy = 0;
	for (int len = 32; len >= 20 && !busy; len -= 12)  /* glibc registers 32 bytes, says 20 */
		busy = syscall(SYS_rseq, rs, len, 0, RSEQ_SIG) == -1 && errno == EBUSY;
	CHECK(busy, "%s: %s", what, strerror(errno));
	cpu_set_t one;
	CPU_ZERO(&one);
	CPU_SET(0, &one);
	sched_setaffinity(0, sizeof one, &one);
	sched_yield();
	snprintf(what, sizeof what, "%s cpu_id on cpu 0", who);
	EQ(what, rs->cpu_id, 0);
}

static void *thread(void *a)
{
	(void)a;
	pthread_barrier_wait(&b);
	pthread_barrier_wait(&b);
	check("thread");
	pthread_barrier_wait(&b);
	return 0;
}

int main(void)
{
	fid_init();
	if (__rseq_size == 0) {
		fprintf(stderr, "setup: glibc did not register rseq\n");
		return 2;
	}
	pthread_barrier_init(&b, 0, 2);
	pthread_t t;
	pthread_create(&t, 0, thread, 0);
	pthread_barrier_wait(&b);
	ready();
	wait_term();
	pthread_barrier_wait(&b);
	check("main");
	pthread_barrier_wait(&b);
	return report();
}
