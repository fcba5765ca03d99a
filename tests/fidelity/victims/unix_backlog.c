/* fidelity: a unix connection still in its listener's backlog (not accepted yet, bytes sent) */
#include "../victim.h"
#include <sys/socket.h>
#include <sys/un.h>

int main(void)
{
	fid_init();
	int l = socket(AF_UNIX, SOCK_STREAM, 0), c = socket(AF_UNIX, SOCK_STREAM, 0);
	MUST(l | c);
	struct sockaddr_un a = {.sun_family = AF_UNIX, .sun_path = "/tmp/fid-listen"};
	MUST(bind(l, (void *)&a, sizeof a));
	MUST(listen(l, 4));
	MUST(connect(c, (void *)&a, sizeof a));
	MUST(send(c, "early", 5, 0));
	ready();
	wait_term();
	int s = accept4(l, 0, 0, SOCK_NONBLOCK);
	CHECK(s >= 0, "accept: %s", strerror(errno));
	char buf[8] = {0};
	EQ("bytes sent before the accept", recv(s, buf, sizeof buf, 0), 5);
	STREQ("bytes", buf, "early");
	EQ("the client still sends", send(c, "late", 4, 0), 4);
	EQ("and they arrive", recv(s, buf, sizeof buf, 0), 4);
	return report();
}
