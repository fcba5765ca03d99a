/* fidelity: messages queued with their senders' credentials (SO_PASSCRED, SCM_CREDENTIALS) */
#include "../victim.h"
#include <sys/socket.h>

int main(void)
{
	fid_init();
	int s[2], one = 1;
	MUST(socketpair(AF_UNIX, SOCK_DGRAM, 0, s));
	MUST(setsockopt(s[1], SOL_SOCKET, SO_PASSCRED, &one, sizeof one));
	MUST(send(s[0], "first", 5, 0));
	pid_t kid = fork();            /* a second sender, alive, in the same workspace */
	if (kid == 0) {
		send(s[0], "second", 6, 0);
		pause();
	}
	usleep(50000);
	ready();
	wait_term();
	pid_t want[2] = {getpid(), kid};
	const char *text[2] = {"first", "second"};
	for (int i = 0; i < 2; i++) {
		char buf[16] = {0}, ctl[CMSG_SPACE(sizeof(struct ucred))];
		struct iovec io = {buf, sizeof buf};
		struct msghdr m = {.msg_iov = &io, .msg_iovlen = 1, .msg_control = ctl, .msg_controllen = sizeof ctl};
		EQ("message length", recvmsg(s[1], &m, MSG_DONTWAIT), (long)strlen(text[i]));
		STREQ("message", buf, text[i]);
		struct cmsghdr *c = CMSG_FIRSTHDR(&m);
		CHECK(c && c->cmsg_type == SCM_CREDENTIALS, "message %d came without credentials", i);
		if (c && c->cmsg_type == SCM_CREDENTIALS) {
			struct ucred u;
			memcpy(&u, CMSG_DATA(c), sizeof u);
			EQ("sender pid", u.pid, want[i]);
			EQ("sender uid", u.uid, 0);
		}
	}
	EQ("SO_PASSCRED", setsockopt(s[1], SOL_SOCKET, SO_PASSCRED, &one, sizeof one), 0);
	kill(kid, SIGKILL);
	return report();
}
