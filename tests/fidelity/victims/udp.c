/* fidelity: UDP sockets (bound, connected, datagrams queued with their senders' addresses) */
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
	usleep(10000);
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
	return report();
}
