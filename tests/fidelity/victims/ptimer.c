/* fidelity: process POSIX timers (ids, clocks, time left, interval, signal and value when fired) */
#include "../victim.h"

#define SIG (SIGRTMIN + 5)

int main(void)
{
	fid_init();
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, SIG);
	sigprocmask(SIG_BLOCK, &s, 0);
	timer_t t[3];
	clockid_t clocks[3] = {CLOCK_MONOTONIC, CLOCK_REALTIME, CLOCK_BOOTTIME};
	for (int i = 0; i < 3; i++) {
		struct sigevent ev = {.sigev_notify = SIGEV_SIGNAL, .sigev_signo = SIG, .sigev_value.sival_int = 10 + i};
		MUST(timer_create(clocks[i], &ev, &t[i]));
	}
	struct itimerspec its = {.it_value = {45, 0}, .it_interval = {0, 250000000}};
	MUST(timer_settime(t[0], 0, &its, 0));
	double armed = now(CLOCK_MONOTONIC);
	its = (struct itimerspec){.it_value = {(time_t)now(CLOCK_REALTIME) + 100, 0}};
	MUST(timer_settime(t[1], TIMER_ABSTIME, &its, 0));
	double deadline = its.it_value.tv_sec;
	ready();                          /* t[2] stays disarmed */
	wait_term();
	struct itimerspec got;
	MUST(timer_gettime(t[0], &got));
	NEAR("monotonic timer left", secs(got.it_value), 45 - (now(CLOCK_MONOTONIC) - armed), 0.25);
	NEAR("monotonic timer interval", secs(got.it_interval), 0.25, 0.001);
	MUST(timer_gettime(t[1], &got));
	NEAR("realtime timer left (absolute)", secs(got.it_value), deadline - now(CLOCK_REALTIME), 0.25);
	MUST(timer_gettime(t[2], &got));
	EQ("disarmed timer", got.it_value.tv_sec + got.it_value.tv_nsec, 0);
	its = (struct itimerspec){.it_value = {0, 10000000}};
	MUST(timer_settime(t[2], 0, &its, 0));
	struct timespec wait = {2, 0};
	siginfo_t si;
	EQ("fired", sigtimedwait(&s, &si, &wait), SIG);
	EQ("si_code", si.si_code, SI_TIMER);
	EQ("value", si.si_value.sival_int, 12);
	EQ("timer id", si.si_timerid, (long)t[2]);
	EQ("timer_getoverrun", timer_getoverrun(t[2]), 0);
	return report();
}
