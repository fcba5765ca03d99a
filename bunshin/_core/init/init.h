/* bunshin-init: PID 1 of a workspace. Sets up the root, then launches and reaps tool calls
 * on behalf of the trainer, which talks to it over the control socket (see proto.h). */
#ifndef BUNSHIN_INIT_H
#define BUNSHIN_INIT_H

#include <stddef.h>
#include <sys/types.h>
#include "proto.h"

/* In a function with ``char *err, size_t errlen``: the message, then ": strerror(errno)", into
 * err; returns -1 with errno kept. */
#define FAIL(...)                                                           \
	do {                                                                \
		int e_ = errno;                                             \
		int n_ = snprintf(err, errlen, __VA_ARGS__);                \
		if (n_ >= 0 && (size_t)n_ < errlen)                         \
			snprintf(err + n_, errlen - n_, ": %s", strerror(e_)); \
		errno = e_;                                                 \
		return -1;                                                  \
	} while (0)

struct setup_cfg {
	const char *root;   /* overlay mount point, becomes "/" */
	const char *lower;  /* overlay lowerdir list, ':'-separated, topmost first */
	const char *upper;
	const char *work;
	const char *hostname;
	const char *cgroups[16]; /* cgroup.procs files to join before anything starts */
	int ncgroups;
};

/* setup.c */
int setup_workspace(const struct setup_cfg *cfg, char *err, size_t errlen);
int mount_submounts(const char *root, char *err, size_t errlen);
int pivot_into(const char *root, char *err, size_t errlen);
int loopback_up(char *err, size_t errlen);
/* nsfds: NULL, or [net, ipc, uts] namespaces to join (made ahead of the fork) */
int reroot_after_fork(int mfd, const int *nsfds, const char *hostname, char *err, size_t errlen);

/* sandbox.c: isolation="sandbox" (a no-op for a trusted workspace) */
int sandbox_apply(const char *root, char *err, size_t errlen);

/* spawn.c */
struct spawned_info {
	pid_t pid;
	int err;
	int step;
};
void spawn_request(const struct bx_msg *m, const char *payload, size_t plen, int *fds, int nfds,
		   struct spawned_info *out);

/* init.c */
int send_msg(uint32_t type, uint64_t id, const void *payload, size_t len);

#endif
