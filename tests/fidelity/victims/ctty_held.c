/* fidelity: /dev/tty held open by processes that are not their session's leader (a child and a grandchild) */
#include "../victim.h"
#include <sys/ioctl.h>
#include <termios.h>

/* The descriptor each process opened /dev/tty as at setup, before ready(). */
static int held = -1;

static void check(const char *who, pid_t sid, const char *name)
{
	char what[80];
	struct stat st;
	dev_t dev = 0;
	stat(name, &st);
	snprintf(what, sizeof what, "%s held /dev/tty is %s", who, name);
	CHECK(ioctl(held, TIOCGDEV, &dev) == 0, "%s: TIOCGDEV: %s", what, strerror(errno));
	EQ(what, dev, st.st_rdev);
	snprintf(what, sizeof what, "%s held /dev/tty's session", who);
	EQ(what, tcgetsid(held), sid);
	snprintf(what, sizeof what, "%s held /dev/tty's foreground group", who);
	EQ(what, tcgetpgrp(held), sid);
	snprintf(what, sizeof what, "%s held /dev/tty's path", who);
	STREQ(what, fdlink(held), "/dev/tty");
	snprintf(what, sizeof what, "%s getsid", who);
	EQ(what, getsid(0), sid);
	snprintf(what, sizeof what, "%s writes to its held /dev/tty", who);
	CHECK(write(held, "", 0) == 0, "%s: %s", what, strerror(errno));
}

/* Runs check() in this process once a byte arrives on ask, then sends its lines (and those of
 * the process it asks in turn) on tell, ending with a NUL. */
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
	int a[2], t[2], ka[2], kt[2], ga[2], gt[2];
	MUST(pipe(a) | pipe(t) | pipe(ka) | pipe(kt) | pipe(ga) | pipe(gt));
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
			MUST(held = open("/dev/tty", O_RDWR));
			if (fork() == 0) { /* and its child */
				MUST(held = open("/dev/tty", O_RDWR | O_CLOEXEC));
				put_file("/tmp/fid-ctty", name);
				answer(ga[0], gt[1], "grandchild", leader, name, -1, -1);
				pause();
			}
			answer(ka[0], kt[1], "child", leader, name, ga[1], gt[0]);
			pause();
		}
		MUST(held = open("/dev/tty", O_RDWR));
		answer(a[0], t[1], "leader", leader, name, ka[1], kt[0]);
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
