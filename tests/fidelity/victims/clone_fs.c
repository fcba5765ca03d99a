/* fidelity: two processes sharing one file system context (CLONE_FS: cwd, root, umask) */
#define _GNU_SOURCE
#include "../victim.h"
#include <sched.h>
#include <sys/wait.h>

static int p[2], q[2];
static char stack[65536] __attribute__((aligned(16)));

/* Answers each question with its own cwd and umask: what the other process set shows here. */
static int sharer(void *a)
{
	(void)a;
	for (;;) {
		char c, cwd[256] = "";
		if (read(p[0], &c, 1) != 1)
			_exit(1);
		if (!getcwd(cwd, sizeof cwd - 8))
			strcpy(cwd, "?");
		mode_t m = umask(0);
		umask(m);
		snprintf(cwd + strlen(cwd), 8, " %03o", (unsigned)m);
		write(q[1], cwd, sizeof cwd);
	}
	return 0;
}

static const char *ask(void)
{
	static char got[256];
	strcpy(got, "(no answer)");
	write(p[1], "?", 1);
	read(q[0], got, sizeof got);
	return got;
}

int main(void)
{
	fid_init();
	MUST(pipe(p) | pipe(q));
	MUST(mkdir("/tmp/fs-a", 0755) | mkdir("/tmp/fs-b", 0755));
	pid_t kid = clone(sharer, stack + sizeof stack, CLONE_FS | SIGCHLD, 0);
	MUST(kid);
	MUST(chdir("/tmp/fs-a"));
	umask(027);
	STREQ("setup: shared", ask(), "/tmp/fs-a 027");
	ready();
	wait_term();
	STREQ("the other process's cwd and umask", ask(), "/tmp/fs-a 027");
	MUST(chdir("/tmp/fs-b"));
	umask(077);
	STREQ("a chdir and umask now move the other process", ask(), "/tmp/fs-b 077");
	kill(kid, SIGKILL);
	return report();
}
