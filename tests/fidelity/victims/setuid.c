/* fidelity: a process running under another uid and gid (a daemon that dropped privileges) */
#include "../victim.h"
#include <grp.h>

int main(void)
{
	fid_init();
	int p[2], q[2];
	MUST(pipe(p) | pipe(q));
	pid_t kid = fork();
	if (kid == 0) {
		gid_t groups[] = {2001, 2002};
		if (setgroups(2, groups) || setresgid(1500, 1501, 1502) || setresuid(1000, 1001, 1002))
			_exit(2);
		char c, line[256];
		read(p[0], &c, 1);
		uid_t r, e, s;
		gid_t gr, ge, gs, g[4];
		getresuid(&r, &e, &s);
		getresgid(&gr, &ge, &gs);
		int n = getgroups(4, g);
		snprintf(line, sizeof line, "%u %u %u %u %u %u %d %u %u", r, e, s, gr, ge, gs, n, g[0], g[1]);
		write(q[1], line, strlen(line) + 1);
		pause();
	}
	usleep(50000);
	ready();
	wait_term();
	MUST(write(p[1], "?", 1));
	char got[256] = {0};
	read(q[0], got, sizeof got - 1);
	STREQ("uids, gids and groups of the other process", got, "1000 1001 1002 1500 1501 1502 2 2001 2002");
	kill(kid, SIGKILL);
	return report();
}
