/* fidelity: two processes sharing memory, neither the other's parent (CLONE_VM | CLONE_PARENT) */
#define _GNU_SOURCE
#include "../victim.h"
#include <sched.h>

static volatile int counter;
static int p[2], q[2];
static char stack[65536] __attribute__((aligned(16)));

static int sharer(void *a)
{
	(void)a;
	for (;;) {
		char c;
		if (read(p[0], &c, 1) != 1)
			_exit(1);
		int got = counter;
		write(q[1], &got, sizeof got);
	}
	return 0;
}

static int ask(void)
{
	int got = -1;
	write(p[1], "?", 1);
	read(q[0], &got, sizeof got);
	return got;
}

int main(void)
{
	fid_init();
	MUST(pipe(p) | pipe(q));
	pid_t kid = clone(sharer, stack + sizeof stack, CLONE_VM | CLONE_PARENT | SIGCHLD, 0);
	MUST(kid);
	counter = 1;
	EQ("setup: shared memory", ask(), 1);
	ready();
	wait_term();
	EQ("the other process's counter", ask(), 1);
	counter = 2;
	EQ("a write now shows in the other process", ask(), 2);
	kill(kid, SIGKILL);
	return report();
}
