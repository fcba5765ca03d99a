/* fidelity: a pty slave opened by its path again by another process (two files, one tty) */
#include "../victim.h"
#include <sys/ioctl.h>
#include <termios.h>

int main(void)
{
	fid_init();
	int m = open("/dev/ptmx", O_RDWR | O_NOCTTY);
	MUST(m);
	MUST(unlockpt(m));
	char name[64];
	strcpy(name, ptsname(m));
	int a = open(name, O_RDWR | O_NOCTTY), b = open(name, O_WRONLY | O_NOCTTY | O_APPEND);
	MUST(a | b);
	struct termios t;
	MUST(tcgetattr(a, &t));
	t.c_lflag &= ~ECHO;            /* canonical, no echo: a line waits for its newline */
	MUST(tcsetattr(a, TCSANOW, &t));
	MUST(write(m, "a line\n", 7));
	MUST(write(b, "out", 3));
	ready();
	wait_term();
	STREQ("slave name", ptsname(m), name);
	struct stat sa, sb, byname;
	MUST(fstat(a, &sa) | fstat(b, &sb) | stat(name, &byname));
	EQ("first slave is the pty", sa.st_rdev, byname.st_rdev);
	EQ("second slave is the pty", sb.st_rdev, byname.st_rdev);
	EQ("second slave flags", fcntl(b, F_GETFL) & (O_ACCMODE | O_APPEND), O_WRONLY | O_APPEND);
	MUST(tcgetattr(b, &t));
	EQ("no ECHO", t.c_lflag & ECHO, 0);
	EQ("ICANON", t.c_lflag & ICANON, ICANON);
	char buf[16] = {0};
	fcntl(a, F_SETFL, O_NONBLOCK);
	fcntl(m, F_SETFL, O_NONBLOCK);
	EQ("line for the slave", read(a, buf, sizeof buf), 7);
	CHECK(!strcmp(buf, "a line\n"), "line: '%.*s', want 'a line' and its newline", (int)strcspn(buf, "\n"), buf);
	memset(buf, 0, sizeof buf);
	EQ("bytes for the master", read(m, buf, sizeof buf), 3);
	STREQ("out", buf, "out");
	MUST(write(b, "more", 4));
	memset(buf, 0, sizeof buf);
	usleep(20000);
	EQ("the second slave still writes to the master", read(m, buf, sizeof buf), 4);
	return report();
}
