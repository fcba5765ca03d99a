/* sleeper: a single-threaded victim blocked in nanosleep, optionally holding memory.
 * usage: sleeper <seconds> [MiB]
 * prints "ready <pid>", then after <seconds> of sleep in total "slept <ms> eintr=<n>".
 * SIGUSR1 (SA_SIGINFO, no SA_RESTART, so nanosleep returns EINTR): prints "usr1 from <si_pid>".
 * SIGUSR2: times 20 native fork()s of this very process, prints "fork_us <median>".
 * SIGCHLD: wakes the loop, which reaps children (clones a test made). */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t usr1_from, usr2;

static void on_usr1(int sig, siginfo_t *si, void *uc) { usr1_from = si->si_pid; }
static void on_usr2(int sig) { usr2 = 1; }
static void on_chld(int sig) {}

static double now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static void fork_bench(void)
{
	double t[20];
	for (int i = 0; i < 20; i++) {
		double t0 = now_us();
		pid_t p = fork();
		if (p == 0)
			_exit(0);
		t[i] = now_us() - t0;
		waitpid(p, NULL, 0);
	}
	qsort(t, 20, sizeof t[0], cmp);
	printf("fork_us %.1f\n", (t[9] + t[10]) / 2);
}

int main(int argc, char **argv)
{
	double secs = argc > 1 ? atof(argv[1]) : 1;
	size_t mib = argc > 2 ? strtoul(argv[2], NULL, 0) : 0;
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (mib) {
		char *buf = mmap(NULL, mib << 20, PROT_READ | PROT_WRITE,
				 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (buf == MAP_FAILED)
			return 1;
		madvise(buf, mib << 20, MADV_NOHUGEPAGE);
		for (size_t i = 0; i < mib << 20; i += 4096)
			buf[i] = (char)i | 1;
	}
	struct sigaction sa = {0};
	sa.sa_sigaction = on_usr1;
	sa.sa_flags = SA_SIGINFO;
	sigaction(SIGUSR1, &sa, NULL);
	signal(SIGUSR2, on_usr2);
	signal(SIGCHLD, on_chld);
	printf("ready %d\n", getpid());
	struct timespec req = {(time_t)secs, (long)((secs - (time_t)secs) * 1e9)}, rem;
	int eintr = 0;
	double t0 = now_us();
	while (nanosleep(&req, &rem)) {
		if (errno != EINTR)
			return 2;
		req = rem;
		while (waitpid(-1, NULL, WNOHANG) > 0)
			;
		if (usr1_from) {
			printf("usr1 from %d\n", (int)usr1_from);
			usr1_from = 0;
			eintr++;
		}
		if (usr2) {
			usr2 = 0;
			fork_bench();
		}
	}
	printf("slept %.0f eintr=%d\n", (now_us() - t0) / 1e3, eintr);
	return 0;
}
