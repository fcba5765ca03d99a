/* fidelity: eventfd (counter, semaphore mode), timerfd (time left, interval, expirations; a
 * disarmed one keeps its interval), signalfd */
#include "../victim.h"
#include <stdint.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <sys/timerfd.h>

int main(void)
{
	fid_init();
	int e = eventfd(7, EFD_NONBLOCK), es = eventfd(2, EFD_SEMAPHORE | EFD_NONBLOCK);
	int t = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK), fired = timerfd_create(CLOCK_MONOTONIC, 0);
	int idle = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK);
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, SIGUSR1);
	sigprocmask(SIG_BLOCK, &s, 0);
	int sf = signalfd(-1, &s, SFD_NONBLOCK | SFD_CLOEXEC);
	MUST(e | es | t | fired | sf | idle);
	struct itimerspec its = {.it_value = {50, 0}, .it_interval = {3, 0}};
	MUST(timerfd_settime(t, 0, &its, 0));
	double armed = now(CLOCK_MONOTONIC);
	its = (struct itimerspec){.it_value = {0, 1000000}};
	MUST(timerfd_settime(fired, 0, &its, 0));
	its = (struct itimerspec){.it_interval = {0, 20000000}};  /* no value: disarmed */
	MUST(timerfd_settime(idle, 0, &its, 0));
	MUST(sigqueue(getpid(), SIGUSR1, (union sigval){.sival_int = 31}));
	usleep(10000);
	ready();
	wait_term();
	uint64_t v = 0;
	EQ("eventfd read", read(e, &v, 8), 8);
	EQ("eventfd counter", v, 7);
	EQ("eventfd now empty", read(e, &v, 8), -1);
	EQ("semaphore read", read(es, &v, 8), 8);
	EQ("semaphore gives 1", v, 1);
	EQ("semaphore read again", read(es, &v, 8), 8);
	EQ("semaphore now empty", read(es, &v, 8), -1);
	struct itimerspec got;
	MUST(timerfd_gettime(t, &got));
	NEAR("timerfd time left", secs(got.it_value), 50 - (now(CLOCK_MONOTONIC) - armed), 0.25);
	NEAR("timerfd interval", secs(got.it_interval), 3, 0.001);
	EQ("expired timerfd read", read(fired, &v, 8), 8);
	EQ("expirations", v, 1);
	usleep(60000);  /* three intervals of the disarmed one */
	EQ("disarmed timerfd never fires", read(idle, &v, 8), -1);
	MUST(timerfd_gettime(idle, &got));
	EQ("disarmed timerfd keeps its interval", got.it_interval.tv_nsec, 20000000);
	EQ("expired timerfd is disarmed", timerfd_gettime(fired, &got) == 0 && got.it_value.tv_sec == 0 && got.it_value.tv_nsec == 0, 1);
	struct signalfd_siginfo si;
	EQ("signalfd read", read(sf, &si, sizeof si), sizeof si);
	EQ("ssi_signo", si.ssi_signo, SIGUSR1);
	EQ("ssi_pid", si.ssi_pid, getpid());
	EQ("ssi_int", si.ssi_int, 31);
	EQ("signalfd FD_CLOEXEC", fcntl(sf, F_GETFD), FD_CLOEXEC);
	EQ("signalfd empty now", read(sf, &si, sizeof si), -1);
	return report();
}
