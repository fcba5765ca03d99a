/* fidelity: a pty pair (same number, slave's owner and mode, termios, window size, bytes both ways) */
#include "../victim.h"
#include <sys/ioctl.h>
#include <termios.h>

int main(void)
{
	fid_init();
	int m = posix_openpt(O_RDWR | O_NOCTTY);
	MUST(m);
	MUST(grantpt(m));
	MUST(unlockpt(m));
	char name[64];
	strcpy(name, ptsname(m));
	int s = open(name, O_RDWR | O_NOCTTY);
	MUST(s);
	MUST(fchown(s, 1234, 5));
	MUST(fchmod(s, 0600));
	struct termios t;
	MUST(tcgetattr(s, &t));
	cfmakeraw(&t);
	t.c_cc[VMIN] = 3;
	cfsetospeed(&t, B9600);
	MUST(tcsetattr(s, TCSANOW, &t));
	struct winsize ws = {.ws_row = 33, .ws_col = 101};
	MUST(ioctl(m, TIOCSWINSZ, &ws));
	MUST(write(m, "to slave", 8));
	MUST(write(s, "to master", 9));
	ready();
	wait_term();
	STREQ("slave name", ptsname(m), name);
	struct stat st, byname;
	MUST(fstat(s, &st));
	MUST(stat(name, &byname));
	EQ("slave is the master's (rdev)", st.st_rdev, byname.st_rdev);
	EQ("slave uid", st.st_uid, 1234);
	EQ("slave gid", st.st_gid, 5);
	EQ("slave mode", st.st_mode & 07777, 0600);
	struct termios g;
	MUST(tcgetattr(s, &g));
	EQ("raw: no ICANON", g.c_lflag & ICANON, 0);
	EQ("VMIN", g.c_cc[VMIN], 3);
	EQ("speed", cfgetospeed(&g), B9600);
	struct winsize gw;
	MUST(ioctl(s, TIOCGWINSZ, &gw));
	EQ("rows", gw.ws_row, 33);
	EQ("cols", gw.ws_col, 101);
	char buf[16] = {0};
	fcntl(s, F_SETFL, O_NONBLOCK);
	fcntl(m, F_SETFL, O_NONBLOCK);
	EQ("bytes for the slave", read(s, buf, sizeof buf), 8);
	STREQ("to slave", buf, "to slave");
	memset(buf, 0, sizeof buf);
	EQ("bytes for the master", read(m, buf, sizeof buf), 9);
	STREQ("to master", buf, "to master");
	return report();
}
