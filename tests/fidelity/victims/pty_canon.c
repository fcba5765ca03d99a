/* fidelity: a pty in canonical mode with lines typed and not read (ends of line: newline, EOL,
 * EOF, an empty EOF line, an escaped erase) and a line still being typed, an LNEXT last */
#include "../victim.h"
#include <poll.h>
#include <sys/ioctl.h>
#include <termios.h>

static int m, s;

static void type(const char *bytes) { MUST(write(m, bytes, strlen(bytes))); }

/* One read of the slave (non-blocking: a line typed now is waited for first), as "LEN:TEXT". */
static const char *line(int wait_ms)
{
	static char out[64];
	char buf[32] = {0};
	struct pollfd p = {.fd = s, .events = POLLIN};
	poll(&p, 1, wait_ms);
	ssize_t n = read(s, buf, sizeof buf - 1);
	snprintf(out, sizeof out, "%zd:%s", n, n > 0 ? buf : "");
	return out;
}

int main(void)
{
	fid_init();
	m = posix_openpt(O_RDWR | O_NOCTTY);
	MUST(m);
	MUST(grantpt(m));
	MUST(unlockpt(m));
	s = open(ptsname(m), O_RDWR | O_NOCTTY | O_NONBLOCK);
	MUST(s);
	struct termios t;
	MUST(tcgetattr(s, &t));
	t.c_lflag &= ~ECHO;  /* ICANON, IEXTEN (^V escapes), ICRNL as by default */
	t.c_cc[VEOL] = '@';
	MUST(tcsetattr(s, TCSANOW, &t));
	type("one\r");           /* ICRNL: "one\n" */
	type("two@");            /* ended by EOL */
	type("three\004");       /* ended by EOF: read without it */
	type("\004");            /* an empty line: a read of 0 */
	type("x\026\177y\n");    /* an erase character escaped: kept */
	type("par\026\ntialXY\177\026");  /* being typed: "par\ntialX", the next byte escaped */
	usleep(20000);
	int inq = -1;
	MUST(ioctl(s, FIONREAD, &inq));
	EQ("setup: bytes in complete lines", inq, 17);
	ready();
	wait_term();
	inq = -1;
	MUST(ioctl(s, FIONREAD, &inq));
	EQ("bytes in complete lines (FIONREAD)", inq, 17);
	STREQ("first line", line(0), "4:one\n");
	STREQ("line ended by EOL", line(0), "4:two@");
	STREQ("line ended by EOF", line(0), "5:three");
	STREQ("empty line ended by EOF", line(0), "0:");
	STREQ("line with an escaped erase", line(0), "4:x\177y\n");
	CHECK(read(s, (char[8]){0}, 8) == -1 && errno == EAGAIN, "the line being typed is readable already");
	type("\n\177\177Z\n");  /* a newline taken as is; two erases take it and the X */
	STREQ("the line typed on, escaped and erased", line(2000), "10:par\ntialZ\n");
	type("\177\177q\n");
	STREQ("an erase stops at the start of the line", line(2000), "2:q\n");
	char echo[8];
	fcntl(m, F_SETFL, O_NONBLOCK);
	CHECK(read(m, echo, sizeof echo) == -1 && errno == EAGAIN, "bytes echoed to the master");
	struct termios g;
	MUST(tcgetattr(s, &g));
	EQ("lflag", g.c_lflag, t.c_lflag);
	EQ("iflag", g.c_iflag, t.c_iflag);
	CHECK(!memcmp(g.c_cc, t.c_cc, sizeof g.c_cc), "control characters changed");
	return report();
}
