/* fidelity: unix sockets unbound, bound unconnected, a bound datagram client connected to a
 * bound server (with a datagram queued), a listener bound to a relative path */
#include "../victim.h"
#include <sys/socket.h>
#include <sys/un.h>

static struct sockaddr_un un(const char *path)
{
	struct sockaddr_un a = {.sun_family = AF_UNIX};
	strcpy(a.sun_path, path);
	return a;
}

static const char *name(int fd, int peer)
{
	static struct sockaddr_un a;
	socklen_t n = sizeof a;
	memset(&a, 0, sizeof a);
	if ((peer ? getpeername : getsockname)(fd, (void *)&a, &n))
		return strerror(errno);
	return n <= sizeof(sa_family_t) ? "(unnamed)" : a.sun_path;
}

int main(void)
{
	fid_init();
	int unbound = socket(AF_UNIX, SOCK_STREAM, 0), bound = socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK, 0);
	int srv = socket(AF_UNIX, SOCK_DGRAM, 0), cli = socket(AF_UNIX, SOCK_DGRAM, 0);
	int lis = socket(AF_UNIX, SOCK_STREAM, 0);
	MUST(unbound | bound | srv | cli | lis);
	struct sockaddr_un a = un("/tmp/fid-bound"), s = un("/tmp/fid-srv"), l = un("fid-rel"), c = un("/tmp/fid-cli");
	MUST(bind(bound, (void *)&a, sizeof a));
	MUST(bind(srv, (void *)&s, sizeof s));
	MUST(bind(cli, (void *)&c, sizeof c));
	MUST(connect(cli, (void *)&s, sizeof s));
	MUST(send(cli, "queued", 6, 0));
	MUST(bind(lis, (void *)&l, sizeof l));  /* cwd is /tmp */
	MUST(listen(lis, 4));
	ready();
	wait_term();
	STREQ("unbound name", name(unbound, 0), "(unnamed)");
	STREQ("unbound peer", name(unbound, 1), strerror(ENOTCONN));
	STREQ("bound name", name(bound, 0), "/tmp/fid-bound");
	EQ("bound flags", fcntl(bound, F_GETFL) & O_NONBLOCK, O_NONBLOCK);
	STREQ("client peer", name(cli, 1), "/tmp/fid-srv");
	STREQ("client name", name(cli, 0), "/tmp/fid-cli");
	char buf[16] = {0};
	struct sockaddr_un from = {0};
	socklen_t fromlen = sizeof from;
	EQ("queued datagram", recvfrom(srv, buf, sizeof buf, MSG_DONTWAIT, (void *)&from, &fromlen), 6);
	STREQ("its sender", from.sun_path, "/tmp/fid-cli");
	STREQ("datagram", buf, "queued");
	EQ("a new datagram", send(cli, "new", 3, 0), 3);
	EQ("arrives", recv(srv, buf, sizeof buf, MSG_DONTWAIT), 3);
	STREQ("listener name", name(lis, 0), "fid-rel");
	int conn = socket(AF_UNIX, SOCK_STREAM, 0);
	struct sockaddr_un full = un("/tmp/fid-rel");
	EQ("connect to the listener by its full path", connect(conn, (void *)&full, sizeof full), 0);
	int acc = accept(lis, 0, 0);
	CHECK(acc >= 0, "accept: %s", strerror(errno));
	EQ("the unbound socket can still connect", connect(unbound, (void *)&full, sizeof full), 0);
	return report();
}
