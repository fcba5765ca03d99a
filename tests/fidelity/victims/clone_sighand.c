/* fidelity: two processes sharing signal handlers and memory (CLONE_SIGHAND | CLONE_VM) */
#define _GNU_SOURCE
#include "../victim.h"
#include <sched.h>
#include <sys/wait.h>

static volatile int counter;       /* one address space: each sees the other's writes */
static volatile sig_atomic_t hits;
static int p[2], q[2];
static char stack[65536] __attribute__((aligned(16)));

static void on_usr1(int sig) { (void)sig; hits++; }

/* Answers each question with the counter it sees and whether SIGUSR1 has a handler here. */
static int sharer(void *a)
{
	(void)a;
	for (;;) {
		char c;
		if (read(p[0], &c, 1) != 1)
			_exit(1);
		struct sigaction sa;
		sigaction(SIGUSR1, 0, &sa);
		int got[2] = {counter, sa.sa_handler == on_usr1};
		write(q[1], got, sizeof got);
	}
	return 0;
}

static void ask(int got[2])
{
	got[0] = got[1] = -1;
	write(p[1], "?", 1);
	read(q[0], got, 2 * sizeof got[0]);
}

int main(void)
{
	fid_init();
	MUST(pipe(p) | pipe(q));
	pid_t kid = clone(sharer, stack + sizeof stack, CLONE_VM | CLONE_SIGHAND | SIGCHLD, 0);
	MUST(kid);
	int got[2];
	counter = 1;
	signal(SIGUSR1, on_usr1);
	ask(got);
	EQ("setup: shared memory", got[0], 1);
	EQ("setup: shared handler", got[1], 1);
	ready();
	wait_term();
	ask(got);
	EQ("the other process's counter", got[0], 1);
	EQ("the other process's handler", got[1], 1);
	counter = 2;
	signal(SIGUSR1, SIG_DFL);
	ask(got);
	EQ("a write now shows in the other process", got[0], 2);
	EQ("a sigaction now changes the other process's", got[1], 0);
	kill(kid, SIGKILL);
	return report();
}
