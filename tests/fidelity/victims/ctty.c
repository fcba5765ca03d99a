/* fidelity: the controlling terminal of a session leader and of a process that is not one */
#include "../victim.h"
#include <sys/ioctl.h>
#include <termios.h>

static void check(const char *who, pid_t sid, const char *name)
{
	char what[80];
	int tty = open("/dev/tty", O_RDWR | O_NOCTTY);
	snprintf(what, sizeof what, "%s opens /dev/tty", who);
	CHECK(tty >= 0, "%s: %s", what, strerror(errno));
	if (tty < 0)
		return;
	struct stat st;
	dev_t dev = 0;
	stat(name, &st);
	ioctl(tty, TIOCGDEV, &dev);
	snprintf(what, sizeof what, "%s ctty is %s", who, name);
	EQ(what, dev, st.st_rdev);
	snprintf(what, sizeof what, "%s tcgetsid", who);
	EQ(what, tcgetsid(tty), sid);
	snprintf(what, sizeof what, "%s foreground group", who);
	EQ(what, tcgetpgrp(tty), sid);
	snprintf(what, sizeof what, "%s getsid", who);
	EQ(what, getsid(0), sid);
	close(tty);
}

/* Runs check() in this process once a byte arrives on ask, then sends its lines (and those of
 * the processes it asked in turn) on tell, ending with a NUL. */
static void answer(int ask, int tell, const char *who, pid_t sid, const char *name, int next_ask, int next_tell)
{
	char c, got[4096] = {0};
	read(ask, &c, 1);
	check(who, sid, name);
	if (next_ask >= 0) {
		write(next_ask, "?", 1);
		read(next_tell, got, sizeof got - 1);
		fid_append(got);
	}
	fid_out[fid_len] = 0;
	write(tell, fid_out, fid_len + 1);
}

int main(void)
{
	fid_init();
	int a[2], t[2], na[2], nt[2];
	MUST(pipe(a) | pipe(t) | pipe(na) | pipe(nt));
	if (fork() == 0) {              /* the spawned victim leads its own session: a child can't */
		MUST(setsid());
		int m = posix_openpt(O_RDWR | O_NOCTTY);
		MUST(m);
		MUST(grantpt(m) | unlockpt(m));
		char name[64];
		strcpy(name, ptsname(m));
		MUST(open(name, O_RDWR));  /* a session leader without a terminal: it becomes ours */
		pid_t leader = getpid();
		if (fork() == 0) {         /* same session, not its leader */
			answer(na[0], nt[1], "non-leader", leader, name, -1, -1);
			pause();
		}
		put_file("/tmp/fid-ctty", name);
		answer(a[0], t[1], "leader", leader, name, na[1], nt[0]);
		pause();
	}
	while (access("/tmp/fid-ctty", F_OK))
		usleep(10000);
	ready();
	wait_term();
	write(a[1], "?", 1);
	char got[8192] = {0};
	read(t[0], got, sizeof got - 1);
	fid_append(got);
	return report();
}
