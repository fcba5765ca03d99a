/* fidelity: interval timers (ITIMER_REAL, ITIMER_VIRTUAL, ITIMER_PROF): time left, interval */
#include "../victim.h"
#include <sys/time.h>

static double tv(struct timeval t) { return t.tv_sec + t.tv_usec / 1e6; }

int main(void)
{
	fid_init();
	signal(SIGALRM, SIG_IGN);
	signal(SIGVTALRM, SIG_IGN);
	signal(SIGPROF, SIG_IGN);
	struct itimerval real = {{2, 500000}, {40, 0}}, virt = {{1, 0}, {30, 0}}, prof = {{0, 0}, {20, 0}};
	MUST(setitimer(ITIMER_REAL, &real, 0));
	double armed = now(CLOCK_MONOTONIC), cpu = now(CLOCK_PROCESS_CPUTIME_ID);
	MUST(setitimer(ITIMER_VIRTUAL, &virt, 0));
	MUST(setitimer(ITIMER_PROF, &prof, 0));
	ready();
	wait_term();
	struct itimerval got;
	getitimer(ITIMER_REAL, &got);
	NEAR("ITIMER_REAL left", tv(got.it_value), 40 - (now(CLOCK_MONOTONIC) - armed), 0.25);
	NEAR("ITIMER_REAL interval", tv(got.it_interval), 2.5, 0.001);
	double used = now(CLOCK_PROCESS_CPUTIME_ID) - cpu;
	getitimer(ITIMER_VIRTUAL, &got);
	NEAR("ITIMER_VIRTUAL left", tv(got.it_value), 30 - used, 0.1);
	NEAR("ITIMER_VIRTUAL interval", tv(got.it_interval), 1, 0.001);
	getitimer(ITIMER_PROF, &got);
	NEAR("ITIMER_PROF left", tv(got.it_value), 20 - used, 0.1);
	EQ("ITIMER_PROF one-shot", got.it_interval.tv_sec + got.it_interval.tv_usec, 0);
	return report();
}
