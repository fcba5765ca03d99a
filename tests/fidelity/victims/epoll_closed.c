/* fidelity: epoll's interest list, with an entry whose descriptor was closed since */
#include "../victim.h"
#include <sys/epoll.h>

int main(void)
{
	fid_init();
	int p[2], q[2];
	MUST(pipe(p) | pipe(q));
	int ep = epoll_create1(EPOLL_CLOEXEC);
	MUST(ep);
	int dup_fd = dup(p[0]);
	struct epoll_event ev = {.events = EPOLLIN, .data.u64 = 0xfeed0001};
	MUST(epoll_ctl(ep, EPOLL_CTL_ADD, dup_fd, &ev));
	close(dup_fd);                 /* the entry stays: p[0] still holds the file */
	ev = (struct epoll_event){.events = EPOLLIN | EPOLLET, .data.u64 = 0xfeed0002};
	MUST(epoll_ctl(ep, EPOLL_CTL_ADD, q[0], &ev));
	ev = (struct epoll_event){.events = EPOLLOUT | EPOLLONESHOT, .data.u64 = 0xfeed0003};
	MUST(epoll_ctl(ep, EPOLL_CTL_ADD, q[1], &ev));
	struct epoll_event out[4];
	MUST(epoll_wait(ep, out, 4, 0));  /* the one-shot entry fires and is disarmed */
	ready();
	wait_term();
	EQ("FD_CLOEXEC", fcntl(ep, F_GETFD), FD_CLOEXEC);
	EQ("nothing ready yet", epoll_wait(ep, out, 4, 0), 0);
	MUST(write(p[1], "x", 1));
	MUST(write(q[1], "y", 1));
	int n = epoll_wait(ep, out, 4, 0);
	EQ("ready entries", n, 2);
	unsigned long long seen = 0;
	for (int i = 0; i < n; i++) {
		seen |= 1ULL << (out[i].data.u64 & 0xf);
		EQ("events", out[i].events, EPOLLIN);
	}
	EQ("entries (bit per tag)", seen, (1 << 1) | (1 << 2));
	EQ("edge-triggered entry fires once", epoll_wait(ep, out, 4, 0), 1);
	ev = (struct epoll_event){.events = EPOLLIN, .data.u64 = 9};
	CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, q[1], &ev) == -1 && errno == EEXIST, "the one-shot entry is gone");
	return report();
}
