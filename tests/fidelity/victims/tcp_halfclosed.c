/* fidelity: a loopback TCP connection one side shut down for writing (FIN sent) */
#include "../victim.h"
#include <netinet/in.h>
#include <sys/socket.h>

int main(void)
{
	fid_init();
	signal(SIGPIPE, SIG_IGN);
	int l = socket(AF_INET, SOCK_STREAM, 0), c = socket(AF_INET, SOCK_STREAM, 0), one = 1;
	MUST(l | c);
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK), .sin_port = htons(47041)};
	MUST(setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one));
	MUST(bind(l, (void *)&a, sizeof a) | listen(l, 4) | connect(c, (void *)&a, sizeof a));
	int s = accept(l, 0, 0);
	MUST(s);
	MUST(send(c, "last words", 10, 0));
	MUST(shutdown(c, SHUT_WR));
	usleep(20000);
	ready();
	wait_term();
	char buf[16] = {0};
	EQ("bytes before the FIN", recv(s, buf, sizeof buf, MSG_DONTWAIT), 10);
	STREQ("bytes", buf, "last words");
	EQ("then EOF", recv(s, buf, sizeof buf, MSG_DONTWAIT), 0);
	EQ("the other way still open", send(s, "answer", 6, 0), 6);
	memset(buf, 0, sizeof buf);
	EQ("the half-closed side reads it", recv(c, buf, sizeof buf, 0), 6);
	CHECK(send(c, "x", 1, 0) == -1 && errno == EPIPE, "send after SHUT_WR did not fail with EPIPE");
	return report();
}
