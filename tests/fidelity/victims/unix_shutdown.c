/* fidelity: unix sockets shut down one way or both (queued bytes before EOF, EPIPE, SOCK_DGRAM) */
#include "../victim.h"
#include <sys/socket.h>

int main(void)
{
	fid_init();
	signal(SIGPIPE, SIG_IGN);
	int s[2], d[2], x[2];
	MUST(socketpair(AF_UNIX, SOCK_STREAM, 0, s));
	MUST(write(s[0], "queued", 6));
	MUST(shutdown(s[0], SHUT_WR));          /* s[1] reads "queued" then EOF */
	MUST(shutdown(s[1], SHUT_RD));          /* and nothing more arrives at s[1]... */
	MUST(write(s[1], "back", 4));           /* ...but it can still write to s[0] */
	MUST(socketpair(AF_UNIX, SOCK_DGRAM, 0, d));
	MUST(write(d[0], "dgram", 5));
	MUST(shutdown(d[0], SHUT_WR));
	MUST(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, x));
	MUST(shutdown(x[0], SHUT_RDWR));
	ready();
	wait_term();
	char buf[16] = {0};
	EQ("bytes queued before the shutdown", recv(s[1], buf, sizeof buf, MSG_DONTWAIT), 6);
	STREQ("queued", buf, "queued");
	EQ("then EOF", recv(s[1], buf, sizeof buf, MSG_DONTWAIT), 0);
	memset(buf, 0, sizeof buf);
	EQ("bytes towards the half that still reads", recv(s[0], buf, sizeof buf, MSG_DONTWAIT), 4);
	STREQ("back", buf, "back");
	CHECK(write(s[0], "x", 1) == -1 && errno == EPIPE, "write after SHUT_WR did not fail with EPIPE");
	EQ("shut-down reader still takes writes (read side shut)", write(s[1], "y", 1), 1);
	EQ("its peer reads them", recv(s[0], buf, 1, MSG_DONTWAIT), 1);
	memset(buf, 0, sizeof buf);
	EQ("datagram queued before the shutdown", recv(d[1], buf, sizeof buf, MSG_DONTWAIT), 5);
	STREQ("datagram", buf, "dgram");
	CHECK(send(d[0], "z", 1, 0) == -1 && errno == EPIPE, "datagram send after SHUT_WR did not fail with EPIPE");
	EQ("SHUT_RDWR seqpacket reads EOF", recv(x[0], buf, 1, MSG_DONTWAIT), 0);
	EQ("its peer reads EOF", recv(x[1], buf, 1, MSG_DONTWAIT), 0);
	return report();
}
