/* fidelity: a descriptor in flight (SCM_RIGHTS, sent and not received yet) */
#include "../victim.h"
#include <sys/socket.h>

int main(void)
{
	fid_init();
	int s[2], p[2];
	MUST(socketpair(AF_UNIX, SOCK_STREAM, 0, s) | pipe(p));
	MUST(write(p[1], "through the pipe", 16));
	char byte = 'x', ctl[CMSG_SPACE(sizeof(int))] = {0};
	struct iovec io = {&byte, 1};
	struct msghdr m = {.msg_iov = &io, .msg_iovlen = 1, .msg_control = ctl, .msg_controllen = sizeof ctl};
	struct cmsghdr *c = CMSG_FIRSTHDR(&m);
	c->cmsg_level = SOL_SOCKET;
	c->cmsg_type = SCM_RIGHTS;
	c->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(c), &p[0], sizeof(int));
	MUST(sendmsg(s[0], &m, 0));
	close(p[0]);                   /* only the message holds the read end now */
	ready();
	wait_term();
	memset(ctl, 0, sizeof ctl);
	m.msg_controllen = sizeof ctl;
	EQ("message", recvmsg(s[1], &m, MSG_DONTWAIT), 1);
	c = CMSG_FIRSTHDR(&m);
	CHECK(c && c->cmsg_type == SCM_RIGHTS, "no descriptor came with the message");
	if (c && c->cmsg_type == SCM_RIGHTS) {
		int fd;
		memcpy(&fd, CMSG_DATA(c), sizeof fd);
		char buf[32] = {0};
		EQ("bytes through the received descriptor", read(fd, buf, sizeof buf), 16);
		STREQ("bytes", buf, "through the pipe");
	}
	return report();
}
