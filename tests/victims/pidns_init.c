/* pidns_init: make a new pid namespace whose init just waits (and reaps), so a test can clone
 * a process into it. Prints "init <host pid of the namespace's pid 1>". Killing that init tears
 * down the namespace and everything in it. */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

int main(void)
{
	if (unshare(CLONE_NEWPID)) {
		perror("unshare");
		return 1;
	}
	pid_t init = fork();
	if (init < 0)
		return 1;
	if (init == 0) {
		for (;;)
			if (wait(NULL) < 0 && errno == ECHILD)
				pause();
	}
	printf("init %d\n", init);
	fflush(stdout);
	waitpid(init, NULL, 0);
	return 0;
}
