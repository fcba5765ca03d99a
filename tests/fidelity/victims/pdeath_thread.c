/* fidelity: parent-death signals set by threads other than the main one (PR_SET_PDEATHSIG is a thread's) */
#include "../each_thread.h"
#include <sys/prctl.h>

/* The signal each thread sets: the main thread SIGUSR2, thread 1 SIGUSR1, thread 2 none. */
static int want(int i) { return i == 0 ? SIGUSR2 : i == 1 ? SIGUSR1 : 0; }

static void setup(int i)
{
	if (want(i))
		MUST(prctl(PR_SET_PDEATHSIG, want(i)));
}

static void check(int i)
{
	int sig = -1;
	char what[64];
	prctl(PR_GET_PDEATHSIG, &sig);
	snprintf(what, sizeof what, "thread %d's PDEATHSIG", i);
	EQ(what, sig, want(i));
}

int main(void)
{
	fid_init();
	each_thread_start();
	ready();
	wait_term();
	each_thread_check();
	return report();
}
