/* fidelity: unix stream connections (a listener on an abstract name, an accepted connection
 * and a socketpair, bytes queued both ways, SOCK_SEQPACKET record boundaries) */
#include "../victim.h"
#include <stddef.h>
#include <sys/socket.h>
#include <sys/un.h>

int main(void)
{
	fid_init();
	int l = socket(AF_UNIX, SOCK_STREAM, 0), c = socket(AF_UNIX, SOCK_STREAM, 0), sp[2];
	MUST(l | c);
	struct sockaddr_un a = {.sun_family = AF_UNIX, .sun_path = "\0fid-abstract"};
	socklen_t len = offsetof(struct sockaddr_un, sun_path) + 1 + strlen("fid-abstract");
	MUST(bind(l, (void *)&a, len));
	MUST(listen(l, 4));
	MUST(connect(c, (void *)&a, len));
	int s = accept(l, 0, 0);
	MUST(s);
	MUST(send(c, "to server", 9, 0));
	MUST(send(s, "to client", 9, 0));
	MUST(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sp));
	MUST(send(sp[0], "rec1", 4, 0));
	MUST(send(sp[0], "record2", 7, 0));
	ready();
	wait_term();
	char buf[16] = {0};
	EQ("bytes for the server", recv(s, buf, sizeof buf, MSG_DONTWAIT), 9);
	STREQ("server reads", buf, "to server");
	memset(buf, 0, sizeof buf);
	EQ("bytes for the client", recv(c, buf, sizeof buf, MSG_DONTWAIT), 9);
	STREQ("client reads", buf, "to client");
	EQ("first record", recv(sp[1], buf, sizeof buf, MSG_DONTWAIT), 4);
	EQ("second record", recv(sp[1], buf, sizeof buf, MSG_DONTWAIT), 7);
	struct sockaddr_un got = {0};
	socklen_t n = sizeof got;
	getsockname(l, (void *)&got, &n);
	EQ("abstract name length", n, len);
	CHECK(!memcmp(got.sun_path, a.sun_path, 13), "listener's abstract name differs");
	int c2 = socket(AF_UNIX, SOCK_STREAM, 0);
	EQ("the listener still takes connections", connect(c2, (void *)&a, len), 0);
	return report();
}
