/* fidelity: open files two processes share (a regular file, a deleted one, a memfd, a pipe): one offset, one set of flags */
#include "../victim.h"
#include <sys/mman.h>

static void both_wrote(const char *what, int fd)
{
	char name[96], buf[8] = {0};
	snprintf(name, sizeof name, "%s offset after both wrote", what);
	EQ(name, lseek(fd, 0, SEEK_CUR), 4);
	snprintf(name, sizeof name, "%s bytes", what);
	EQ(name, pread(fd, buf, 4, 0), 4);
	STREQ(name, buf, "abPC");
}

int main(void)
{
	fid_init();
	int f = open("/tmp/fid-shared", O_RDWR | O_CREAT | O_TRUNC, 0644);
	MUST(f);
	int g = open("/tmp/fid-shared-gone", O_RDWR | O_CREAT | O_TRUNC, 0644);
	MUST(g);
	MUST(unlink("/tmp/fid-shared-gone"));
	int m = memfd_create("fid-shared", 0);
	MUST(m);
	int fds[] = {f, g, m};
	for (int i = 0; i < 3; i++)
		MUST(write(fds[i], "ab", 2));
	int p[2], ask[2], ans[2];
	MUST(pipe(p));
	MUST(pipe(ask));
	MUST(pipe(ans));
	pid_t kid = fork();
	MUST(kid);
	if (kid == 0) {                 /* writes after the other, once asked */
		char c;
		while (read(ask[0], &c, 1) == 1) {
			for (int i = 0; i < 3; i++)
				if (write(fds[i], "C", 1) != 1)
					c = '!';
			fcntl(p[0], F_SETFL, O_NONBLOCK);
			if (write(ans[1], &c, 1) != 1)
				_exit(1);
		}
		_exit(0);
	}
	ready();
	wait_term();
	for (int i = 0; i < 3; i++) {
		EQ("offset", lseek(fds[i], 0, SEEK_CUR), 2);
		MUST(write(fds[i], "P", 1));
	}
	char c = 'w';
	MUST(write(ask[1], &c, 1));
	MUST(read(ans[0], &c, 1));
	CHAREQ("the other process's writes", c, 'w');
	both_wrote("file", f);
	both_wrote("deleted file", g);
	both_wrote("memfd", m);
	CHECK(fcntl(p[0], F_GETFL) & O_NONBLOCK, "the other process's O_NONBLOCK on the pipe they share is not seen");
	kill(kid, SIGKILL);
	return report();
}
