/* fidelity: deadlines of calls blocked at the fork (poll, nanosleep, a timed futex wait, select, ppoll) */
#include "../victim.h"
#include <poll.h>
#include <pthread.h>
#include <sys/select.h>

#define WAIT 2.0
#define N 5
static double started, woke[N];
static int polled, poll_errno;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t never = PTHREAD_COND_INITIALIZER;

static void *sleeper(void *a)
{
	int i = (int)(long)a;
	if (i == 0) {
		polled = poll(0, 0, (int)(WAIT * 1000));
		poll_errno = errno;
	} else if (i == 1) {
		struct timespec t = {(time_t)WAIT, 0};
		while (nanosleep(&t, &t))
			;
	} else if (i == 3) {  /* restarted with the time left it writes back */
		struct timeval t = {(time_t)WAIT, 0};
		while (select(0, 0, 0, 0, &t))
			;
	} else if (i == 4) {
		struct timespec t = {(time_t)WAIT, 0};
		while (ppoll(0, 0, &t, 0))
			;
	} else {
		struct timespec t;
		clock_gettime(CLOCK_REALTIME, &t);
		t.tv_sec += (time_t)WAIT;
		pthread_mutex_lock(&mu);
		while (pthread_cond_timedwait(&never, &mu, &t) != ETIMEDOUT)
			;
		pthread_mutex_unlock(&mu);
	}
	woke[i] = now(CLOCK_MONOTONIC);
	return 0;
}

int main(void)
{
	fid_init();
	pthread_t t[N];
	started = now(CLOCK_MONOTONIC);
	for (long i = 0; i < N; i++)
		pthread_create(&t[i], 0, sleeper, (void *)i);
	ready();
	wait_term();
	double term = now(CLOCK_MONOTONIC);  /* the fork came before: its moment is at most this */
	static const char *what[N] = {"poll woke after", "nanosleep woke after", "timed condition wait woke after",
				      "select woke after", "ppoll woke after"};
	for (int i = 0; i < N; i++)
		pthread_join(t[i], 0);
	CHECK(polled == 0, "poll returned %d (%s), want 0 (timed out)", polled, strerror(poll_errno));
	/* A poll in a thread other than the main one, recreated in a child without the task's
	 * restart block, waits its whole timeout again from the fork (docs/fork-table.md): late
	 * by at most the time it had waited, which a slow machine makes longer than the tolerance. */
	double late = term - started;
	CHECK(woke[0] - started >= WAIT - 0.3 && woke[0] - started <= WAIT + late + 0.3,
	      "%s: %.3f, want %.3f to %.3f", what[0], woke[0] - started, WAIT - 0.3, WAIT + late + 0.3);
	for (int i = 1; i < N; i++)
		NEAR(what[i], woke[i] - started, WAIT, 0.3);
	return report();
}
