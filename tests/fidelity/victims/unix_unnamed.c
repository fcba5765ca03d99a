/* fidelity: a datagram queued from an unbound unix socket (its sender has no name) */
#include "../victim.h"
#include <sys/socket.h>
#include <sys/un.h>

int main(void)
{
	fid_init();
	int srv = socket(AF_UNIX, SOCK_DGRAM, 0), cli = socket(AF_UNIX, SOCK_DGRAM, 0);
	MUST(srv | cli);
	struct sockaddr_un s = {.sun_family = AF_UNIX, .sun_path = "/tmp/fid-srv"};
	MUST(bind(srv, (void *)&s, sizeof s));
	MUST(connect(cli, (void *)&s, sizeof s));
	MUST(send(cli, "from nobody", 11, 0));
	ready();
	wait_term();
	char buf[16] = {0};
	struct sockaddr_un from;
	socklen_t n = sizeof from;
	EQ("queued datagram", recvfrom(srv, buf, sizeof buf, MSG_DONTWAIT, (void *)&from, &n), 11);
	STREQ("datagram", buf, "from nobody");
	CHECK(n <= sizeof(sa_family_t), "its sender has a name (%u bytes)", n);
	EQ("a new datagram", send(cli, "again", 5, 0), 5);
	EQ("arrives", recv(srv, buf, sizeof buf, MSG_DONTWAIT), 5);
	return report();
}
