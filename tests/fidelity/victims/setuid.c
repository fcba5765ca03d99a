/* fidelity: a process running under another uid and gid (a daemon that dropped privileges), holding a deleted file in a directory it cannot write */
#include "../victim.h"
#include <grp.h>

int main(void)
{
	fid_init();
	int p[2], q[2];
	MUST(pipe(p) | pipe(q));
	MUST(mkdir("/fid-root", 0755));
	int kept = open("/fid-root/kept", O_RDWR | O_CREAT | O_EXCL, 0640);  /* root's, in root's directory */
	MUST(kept);
	MUST(write(kept, "kept", 4));
	MUST(unlink("/fid-root/kept"));
	pid_t kid = fork();
	if (kid == 0) {
		gid_t groups[] = {2001, 2002};
		if (setgroups(2, groups) || setresgid(1500, 1501, 1502) || setresuid(1000, 1001, 1002))
			_exit(2);
		char c, line[1024];
		read(p[0], &c, 1);
		uid_t r, e, s;
		gid_t gr, ge, gs, g[4];
		getresuid(&r, &e, &s);
		getresgid(&gr, &ge, &gs);
		int n = getgroups(4, g);
		struct stat st;
		char buf[8] = {0};
		fstat(kept, &st);
		pread(kept, buf, sizeof buf - 1, 0);
		snprintf(line, sizeof line, "%u %u %u %u %u %u %d %u %u; %s %o %u %s", r, e, s, gr, ge, gs, n, g[0], g[1],
			 fdlink(kept), st.st_mode, st.st_uid, buf);
		write(q[1], line, strlen(line) + 1);
		pause();
	}
	usleep(50000);
	ready();
	wait_term();
	MUST(write(p[1], "?", 1));
	char got[1024] = {0};
	read(q[0], got, sizeof got - 1);
	STREQ("uids, gids and groups of the other process; its deleted file's name, mode, owner and bytes", got,
	      "1000 1001 1002 1500 1501 1502 2 2001 2002; /fid-root/kept (deleted) 100640 0 kept");
	kill(kid, SIGKILL);
	return report();
}
