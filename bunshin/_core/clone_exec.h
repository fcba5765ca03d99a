#ifndef BUNSHIN_CLONE_EXEC_H
#define BUNSHIN_CLONE_EXEC_H
#include <sys/types.h>
/* Starts `path` as the first process of fresh namespaces (flags: CLONE_NEW*), with
 * fds 0..2 = stdio[0..2] and fd 3 = ctl. Returns the host pid, stores a pidfd in *pidfd.
 * With CLONE_NEWUSER the child waits for the byte 'g' on ctl (sent once its uid and gid maps
 * are written) and runs `path` as uid and gid 0 of its new user namespace. */
pid_t bx_clone_exec(unsigned long long flags, const char *path, char *const argv[], char *const envp[],
		    const int stdio[3], int ctl, int *pidfd);
long bx_openat2(int dirfd, const char *path, unsigned long long flags, unsigned long long mode,
		unsigned long long resolve);
#endif
