/* fidelity: a loopback TCP connection mid-stream (bytes queued both ways, addresses, options) */
#include "../victim.h"
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

static int port(int fd, int peer)
{
	struct sockaddr_in a;
	socklen_t n = sizeof a;
	if ((peer ? getpeername : getsockname)(fd, (void *)&a, &n))
		return -1;
	return ntohs(a.sin_port);
}

int main(void)
{
	fid_init();
	int l = socket(AF_INET, SOCK_STREAM, 0), c = socket(AF_INET, SOCK_STREAM, 0), one = 1;
	MUST(l | c);
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK), .sin_port = htons(47021)};
	MUST(setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one));
	MUST(bind(l, (void *)&a, sizeof a));
	MUST(listen(l, 4));
	MUST(connect(c, (void *)&a, sizeof a));
	int s = accept(l, 0, 0);
	MUST(s);
	MUST(setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one));
	MUST(send(c, "from the client", 15, 0));
	MUST(send(s, "from the server", 15, 0));
	int cport = port(c, 0);
	usleep(20000);
	ready();
	wait_term();
	EQ("client port", port(c, 0), cport);
	EQ("client's peer", port(c, 1), 47021);
	EQ("server's peer", port(s, 1), cport);
	int v = 0;
	socklen_t n = sizeof v;
	getsockopt(c, IPPROTO_TCP, TCP_NODELAY, &v, &n);
	EQ("TCP_NODELAY", v, 1);
	char buf[32] = {0};
	EQ("bytes for the server", recv(s, buf, sizeof buf, MSG_DONTWAIT), 15);
	STREQ("server reads", buf, "from the client");
	memset(buf, 0, sizeof buf);
	EQ("bytes for the client", recv(c, buf, sizeof buf, MSG_DONTWAIT), 15);
	STREQ("client reads", buf, "from the server");
	EQ("send again", send(c, "more", 4, 0), 4);
	memset(buf, 0, sizeof buf);
	EQ("arrives", recv(s, buf, sizeof buf, 0), 4);
	int c2 = socket(AF_INET, SOCK_STREAM, 0);
	EQ("the listener still accepts", connect(c2, (void *)&a, sizeof a), 0);
	return report();
}
