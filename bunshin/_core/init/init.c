/* bunshin-init: PID 1 of a workspace.
 *
 * usage: bunshin-init [--root DIR --lower L --upper U --work W] [--hostname H] [--cgroup PROCS]...
 *                     [--cgroupns 1]
 * The control socket is fd 3 (BX_CTL_FD). When it closes, the trainer is gone: init kills every
 * process of the workspace and exits, so a crashed trainer leaves no orphans behind. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include "init.h"

static int ctl = BX_CTL_FD;
/* Each root it moves into (REROOT) gets a cgroup namespace of its own, rooted at the cgroup the
 * trainer put it in by then. A forked init is a copy of this one: its forks do the same. */
static int own_cgroupns;
static pid_t *tracked;
static size_t ntracked, captracked;

int send_msg(uint32_t type, uint64_t id, const void *payload, size_t len)
{
	struct bx_msg h = {.type = type, .id = id, .len = (uint32_t)len};
	struct iovec iov[2] = {{&h, sizeof(h)}, {(void *)payload, len}};
	struct msghdr mh = {.msg_iov = iov, .msg_iovlen = len ? 2 : 1};
	ssize_t n;
	do
		n = sendmsg(ctl, &mh, MSG_NOSIGNAL);
	while (n < 0 && errno == EINTR);
	return n < 0 ? -1 : 0;
}

static void track(pid_t pid)
{
	if (ntracked == captracked) {
		size_t cap = captracked ? captracked * 2 : 64;
		pid_t *t = realloc(tracked, cap * sizeof(pid_t));
		if (!t)
			return; /* the exit will not be reported; the trainer times out instead */
		tracked = t;
		captracked = cap;
	}
	tracked[ntracked++] = pid;
}

static int untrack(pid_t pid)
{
	for (size_t i = 0; i < ntracked; i++)
		if (tracked[i] == pid) {
			tracked[i] = tracked[--ntracked];
			return 1;
		}
	return 0;
}

static void reap(void)
{
	int st;
	pid_t pid;
	while ((pid = waitpid(-1, &st, WNOHANG)) > 0)
		if (untrack(pid)) {
			struct bx_exited e = {.pid = pid, .status = st};
			send_msg(BX_REP_EXITED, 0, &e, sizeof(e));
		}
}

static __attribute__((noreturn)) void shutdown_all(int code)
{
	kill(-1, SIGKILL);
	while (waitpid(-1, NULL, 0) > 0 || errno == EINTR)
		;
	exit(code);
}

static void ack(uint64_t id, int32_t err)
{
	send_msg(BX_REP_ACK, id, &err, sizeof(err));
}

/* A forked init reads this from the control socket it still shares with its template (which
 * is frozen and cannot compete for it), then moves to its own root and its own socket. */
static void reroot(const struct bx_msg *m, const char *payload, size_t plen, int *fds, int nfds)
{
	char err[1024] = "", host[256] = "";
	/* The template's init we were cloned from ignores SIGCHLD so that the kernel reaps its
	 * children (seize.ignore_children); ours come through the signalfd, with their status. */
	signal(SIGCHLD, SIG_DFL);
	if (nfds != 2 && nfds != 5) {
		ack(m->id, EINVAL);
		return;
	}
	if (plen && plen < sizeof(host)) {
		memcpy(host, payload, plen);
		host[plen] = 0;
	}
	int r = 0;
	if (own_cgroupns && unshare(CLONE_NEWCGROUP)) {
		snprintf(err, sizeof(err), "a cgroup namespace of its own: %s", strerror(errno));
		r = -1;
	}
	if (!r)
		r = reroot_after_fork(fds[0], nfds == 5 ? fds + 2 : NULL, host, err, sizeof(err));
	if (dup3(fds[1], ctl, O_CLOEXEC) < 0)
		exit(1);
	if (r) {
		send_msg(BX_REP_FATAL, m->id, err, strlen(err));
		exit(1);
	}
	struct bx_ready ready = {.version = BX_PROTO_VERSION, .pid = getpid()};
	send_msg(BX_REP_READY, m->id, &ready, sizeof(ready));
}

static void handle(const struct bx_msg *m, const char *payload, size_t plen, int *fds, int nfds)
{
	switch (m->type) {
	case BX_REQ_SPAWN: {
		struct spawned_info si;
		spawn_request(m, payload, plen, fds, nfds, &si);
		struct bx_spawned r = {.pid = si.pid, .err = si.err, .step = si.step};
		if (si.pid > 0 && !si.err && (m->flags & BX_SPAWN_TRACK))
			track(si.pid);
		send_msg(BX_REP_SPAWNED, m->id, &r, sizeof(r));
		break;
	}
	case BX_REQ_KILL: {
		struct bx_kill k;
		if (plen < sizeof(k)) {
			ack(m->id, EINVAL);
			break;
		}
		memcpy(&k, payload, sizeof(k));
		int r;
		if (k.scope == BX_KILL_ALL)
			r = kill(-1, k.sig);
		else if (k.pid <= 1)
			r = (errno = EPERM, -1); /* never signal init through a pid request */
		else
			r = kill(k.scope == BX_KILL_PGRP ? -k.pid : k.pid, k.sig);
		ack(m->id, r ? errno : 0);
		break;
	}
	case BX_REQ_PING:
		ack(m->id, 0);
		break;
	case BX_REQ_REROOT:
		reroot(m, payload, plen, fds, nfds);
		break;
	case BX_REQ_SHUTDOWN:
		ack(m->id, 0);
		shutdown_all(0);
	default:
		ack(m->id, ENOSYS);
	}
}

/* Receives one request; returns 0 at EOF (trainer gone). */
static int serve_one(char *buf, size_t buflen)
{
	union {
		struct cmsghdr align;
		char b[CMSG_SPACE(sizeof(int) * BX_MAX_FDS)];
	} cbuf;
	struct iovec iov = {buf, buflen};
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf.b,
			    .msg_controllen = sizeof(cbuf.b)};
	ssize_t n = recvmsg(ctl, &mh, MSG_CMSG_CLOEXEC);
	if (n < 0)
		return errno == EINTR || errno == EAGAIN ? 1 : 0;
	if (n == 0)
		return 0;
	int fds[BX_MAX_FDS], nfds = 0;
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
		if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
			int k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
			for (int i = 0; i < k && nfds < BX_MAX_FDS; i++)
				memcpy(&fds[nfds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
		}
	struct bx_msg m;
	if ((size_t)n < sizeof(m)) {
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		return 1;
	}
	memcpy(&m, buf, sizeof(m));
	const char *payload = buf + sizeof(m);
	size_t plen = n - sizeof(m);
	char *big = NULL;
	if ((m.flags & BX_F_PAYLOAD_FD) && nfds > 0) {
		int pfd = fds[--nfds];
		big = mmap(NULL, m.len ? m.len : 1, PROT_READ, MAP_PRIVATE, pfd, 0);
		close(pfd);
		if (big == MAP_FAILED) {
			big = NULL;
			plen = 0;
		} else {
			payload = big;
			plen = m.len;
		}
	}
	handle(&m, payload, plen, fds, nfds);
	if (big)
		munmap(big, m.len ? m.len : 1);
	for (int i = 0; i < nfds; i++)
		close(fds[i]);
	return 1;
}

int main(int argc, char **argv)
{
	struct setup_cfg cfg = {0};
	for (int i = 1; i + 1 < argc; i += 2) {
		const char *k = argv[i], *v = argv[i + 1];
		if (!strcmp(k, "--root"))
			cfg.root = v;
		else if (!strcmp(k, "--lower"))
			cfg.lower = v;
		else if (!strcmp(k, "--upper"))
			cfg.upper = v;
		else if (!strcmp(k, "--work"))
			cfg.work = v;
		else if (!strcmp(k, "--hostname"))
			cfg.hostname = v;
		else if (!strcmp(k, "--cgroup") && cfg.ncgroups < 16)
			cfg.cgroups[cfg.ncgroups++] = v;
		else if (!strcmp(k, "--cgroupns"))
			own_cgroupns = !strcmp(v, "1");
		else {
			fprintf(stderr, "bunshin-init: unknown option %s\n", k);
			return 2;
		}
	}
	fcntl(ctl, F_SETFD, FD_CLOEXEC);

	/* Signals are read from a signalfd so that the loop below never races a handler. */
	sigset_t all;
	sigfillset(&all);
	sigprocmask(SIG_SETMASK, &all, NULL);
	signal(SIGPIPE, SIG_IGN);
	sigset_t want;
	sigemptyset(&want);
	sigaddset(&want, SIGCHLD);
	int sfd = signalfd(-1, &want, SFD_CLOEXEC | SFD_NONBLOCK);

	char err[1024] = "";
	if (setup_workspace(&cfg, err, sizeof(err))) {
		send_msg(BX_REP_FATAL, 0, err, strlen(err));
		fprintf(stderr, "bunshin-init: %s\n", err);
		return 1;
	}
	struct bx_ready r = {.version = BX_PROTO_VERSION, .pid = getpid()};
	if (send_msg(BX_REP_READY, 0, &r, sizeof(r)))
		return 1;

	size_t buflen = sizeof(struct bx_msg) + BX_MAX_INLINE + 4096;
	char *buf = malloc(buflen);
	struct pollfd pf[2] = {{.fd = ctl, .events = POLLIN}, {.fd = sfd, .events = POLLIN}};
	for (;;) {
		if (poll(pf, 2, -1) < 0 && errno != EINTR)
			shutdown_all(1);
		if (pf[1].revents) {
			struct signalfd_siginfo si;
			while (read(sfd, &si, sizeof(si)) == sizeof(si))
				;
			reap();
		}
		if (pf[0].revents & POLLIN) {
			if (!serve_one(buf, buflen))
				shutdown_all(0);
		} else if (pf[0].revents & (POLLHUP | POLLERR | POLLNVAL)) {
			shutdown_all(0);
		}
	}
}
