/* fidelity: two processes sharing one descriptor table (CLONE_FILES) */
#define _GNU_SOURCE
#include "../victim.h"
#include <sched.h>
#include <sys/wait.h>

static int p[2], q[2];
static char stack[65536] __attribute__((aligned(16)));

static int sharer(void *a)
{
	(void)a;
	for (;;) {
		int fd = -1;
		if (read(p[0], &fd, sizeof fd) != sizeof fd)
			_exit(1);
		int ok = fcntl(fd, F_GETFD) != -1;   /* a descriptor the other process opened (or closed) */
		write(q[1], &ok, sizeof ok);
	}
	return 0;
}

static int ask(int fd)
{
	int ok = -1;
	write(p[1], &fd, sizeof fd);
	read(q[0], &ok, sizeof ok);
	return ok;
}

int main(void)
{
	fid_init();
	MUST(pipe(p) | pipe(q));
	pid_t kid = clone(sharer, stack + sizeof stack, CLONE_FILES | SIGCHLD, 0);
	MUST(kid);
	int before = open("/dev/null", O_RDONLY);
	MUST(before);
	EQ("setup: shared", ask(before), 1);
	ready();
	wait_term();
	EQ("the other process sees a descriptor opened before", ask(before), 1);
	int after = open("/dev/null", O_RDONLY);
	EQ("the other process sees a descriptor opened now", ask(after), 1);
	close(before);
	EQ("the other process sees a descriptor closed now", ask(before), 0);
	kill(kid, SIGKILL);
	return report();
}
