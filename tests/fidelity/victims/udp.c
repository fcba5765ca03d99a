/* fidelity: UDP sockets (bound, connected, datagrams queued with their senders' addresses; a
 * peek offset (SO_PEEK_OFF) where the socket's peeks left it) */
#include "../victim.h"
#include <netinet/in.h>
#include <sys/socket.h>

static struct sockaddr_in at(int port)
{
	return (struct sockaddr_in){.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK), .sin_port = htons(port)};
}

int main(void)
{
	fid_init();
	int srv = socket(AF_INET, SOCK_DGRAM, 0), cli = socket(AF_INET, SOCK_DGRAM, 0);
	MUST(srv | cli);
	struct sockaddr_in s = at(47031), c = at(47032);
	MUST(bind(srv, (void *)&s, sizeof s));
	MUST(bind(cli, (void *)&c, sizeof c));
	MUST(connect(cli, (void *)&s, sizeof s));
	MUST(send(cli, "one", 3, 0));
	MUST(send(cli, "two!", 4, 0));
	MUST(sendto(srv, "reply", 5, 0, (void *)&c, sizeof c));
	int pk = socket(AF_INET, SOCK_DGRAM, 0), zero = 0;
	struct sockaddr_in p = at(47033);
	MUST(pk);
	MUST(bind(pk, (void *)&p, sizeof p));
	int peeking = setsockopt(pk, SOL_SOCKET, SO_PEEK_OFF, &zero, sizeof zero) == 0;  /* Linux 6.9+ */
	MUST(sendto(cli, "ab", 2, 0, (void *)&p, sizeof p));
	MUST(sendto(cli, "cde", 3, 0, (void *)&p, sizeof p));
	usleep(10000);
	char peeked[8] = {0};
	if (peeking)
		EQ("first peek", recv(pk, peeked, sizeof peeked, MSG_PEEK | MSG_DONTWAIT), 2);
	ready();
	wait_term();
	static const char *want[] = {"one", "two!"};
	for (int i = 0; i < 2; i++) {
		char buf[16] = {0};
		struct sockaddr_in from = {0};
		socklen_t n = sizeof from;
		EQ("datagram length", recvfrom(srv, buf, sizeof buf, MSG_DONTWAIT, (void *)&from, &n), (long)strlen(want[i]));
		STREQ("datagram", buf, want[i]);
		EQ("sender port", ntohs(from.sin_port), 47032);
	}
	char buf[16] = {0};
	EQ("reply for the client", recv(cli, buf, sizeof buf, MSG_DONTWAIT), 5);
	STREQ("reply", buf, "reply");
	struct sockaddr_in peer;
	socklen_t n = sizeof peer;
	EQ("the client is connected", getpeername(cli, (void *)&peer, &n), 0);
	EQ("to the server's port", ntohs(peer.sin_port), 47031);
	EQ("send again", send(cli, "three", 5, 0), 5);
	EQ("arrives", recv(srv, buf, sizeof buf, 0), 5);
	if (peeking) {
		int off = -2;
		socklen_t len = sizeof off;
		MUST(getsockopt(pk, SOL_SOCKET, SO_PEEK_OFF, &off, &len));
		EQ("peek offset past the first datagram", off, 2);
		memset(peeked, 0, sizeof peeked);
		EQ("next peek", recv(pk, peeked, sizeof peeked, MSG_PEEK | MSG_DONTWAIT), 3);
		STREQ("next peek gives the second", peeked, "cde");
	}
	memset(buf, 0, sizeof buf);
	EQ("a read gives the first", recv(pk, buf, sizeof buf, MSG_DONTWAIT), 2);
	STREQ("the first", buf, "ab");
	return report();
}
