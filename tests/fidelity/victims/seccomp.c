/* fidelity: a seccomp filter (the calls it refuses, with its errno; filter count in /proc) */
#include "../victim.h"
#include <stddef.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>

int main(void)
{
	fid_init();
	struct sock_filter f[] = {
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_getpgid, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | 77),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
	};
	struct sock_fprog prog = {sizeof f / sizeof *f, f};
	/* filters it inherited (a sandbox workspace's init has one) */
	const char *had = strstr(slurp("/proc/self/status"), "Seccomp_filters:");
	long base = had ? strtol(had + strlen("Seccomp_filters:"), NULL, 10) : 0;
	MUST(prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog));
	ready();
	wait_term();
	long r = syscall(SYS_getpgid, 0);
	CHECK(r == -1 && errno == 77, "getpgid: %ld errno %d, want -1 errno 77", r, errno);
	EQ("other calls allowed", syscall(SYS_getpid), getpid());
	const char *st = slurp("/proc/self/status");
	const char *mode = strstr(st, "Seccomp:"), *n = strstr(st, "Seccomp_filters:");
	CHECK(mode && !strncmp(mode, "Seccomp:\t2", 10), "Seccomp mode: %.12s", mode ? mode : "?");
	EQ("filters", n ? strtol(n + strlen("Seccomp_filters:"), NULL, 10) : -1, base + 1);
	return report();
}
