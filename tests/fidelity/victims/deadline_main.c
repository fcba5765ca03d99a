/* fidelity: the deadline of a select blocked in the main thread at the fork (its time left in the caller's memory) */
#include "../victim.h"
#include <sys/select.h>

#define WAIT 2.0

int main(void)
{
	fid_init();
	double started = now(CLOCK_MONOTONIC);
	struct timeval t = {(time_t)WAIT, 0};
	ready();
	int got;
	while ((got = select(0, 0, 0, 0, &t)))
		MUST(got);
	double woke = now(CLOCK_MONOTONIC);
	wait_term();
	NEAR("select woke after", woke - started, WAIT, 0.3);
	return report();
}
