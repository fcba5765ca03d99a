/* fidelity: POSIX (fcntl), OFD and flock locks: held, by whom, on which ranges */
#include "../victim.h"
#include <sys/file.h>
#include <sys/wait.h>

static struct flock probe(int cmd, int fd, short type, off_t start, off_t len)
{
	struct flock l = {.l_type = type, .l_whence = SEEK_SET, .l_start = start, .l_len = len};
	if (fcntl(fd, cmd, &l) == -1)
		l.l_type = -1;
	return l;
}

int main(void)
{
	fid_init();
	int fd = open("/tmp/fid-locked", O_RDWR | O_CREAT, 0644);
	MUST(fd);
	MUST(ftruncate(fd, 100));
	struct flock w = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 10};
	MUST(fcntl(fd, F_SETLK, &w));
	int ofd = open("/tmp/fid-locked", O_RDWR);
	MUST(ofd);
	struct flock r = {.l_type = F_RDLCK, .l_whence = SEEK_SET, .l_start = 20, .l_len = 10};
	MUST(fcntl(ofd, F_OFD_SETLK, &r));
	int ffd = open("/tmp/fid-flocked", O_RDWR | O_CREAT, 0644);
	MUST(ffd);
	MUST(flock(ffd, LOCK_EX));
	ready();
	wait_term();
	pid_t me = getpid();
	int pipefd[2];
	MUST(pipe(pipefd));
	pid_t kid = fork();
	if (kid == 0) {  /* another process asks who holds what */
		int o = open("/tmp/fid-locked", O_RDWR), f = open("/tmp/fid-flocked", O_RDWR);
		struct flock got[4] = {probe(F_GETLK, o, F_WRLCK, 0, 10), probe(F_OFD_GETLK, o, F_WRLCK, 20, 10),
		                       probe(F_GETLK, o, F_WRLCK, 40, 10)};
		got[3].l_type = flock(f, LOCK_EX | LOCK_NB) == -1 && errno == EWOULDBLOCK ? F_WRLCK : F_UNLCK;
		write(pipefd[1], got, sizeof got);
		_exit(0);
	}
	struct flock got[4];
	EQ("probe", read(pipefd[0], got, sizeof got), sizeof got);
	waitpid(kid, 0, 0);
	EQ("POSIX lock 0-10 type", got[0].l_type, F_WRLCK);
	EQ("POSIX lock holder", got[0].l_pid, me);
	EQ("POSIX lock start", got[0].l_start, 0);
	EQ("POSIX lock len", got[0].l_len, 10);
	EQ("OFD lock 20-30 type", got[1].l_type, F_RDLCK);
	EQ("OFD lock pid (-1)", got[1].l_pid, -1);
	EQ("OFD lock start", got[1].l_start, 20);
	EQ("unlocked range 40-50", got[2].l_type, F_UNLCK);
	EQ("flock held (another LOCK_EX would block)", got[3].l_type, F_WRLCK);
	struct flock mine = probe(F_OFD_GETLK, fd, F_WRLCK, 20, 10);
	EQ("OFD lock seen from the POSIX fd", mine.l_type, F_RDLCK);
	return report();
}
