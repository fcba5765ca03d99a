/* fidelity: descriptors of the process's own namespaces (files of /proc/self/ns) */
#include "../victim.h"
#include <sched.h>
#include <sys/ioctl.h>
#include <linux/nsfs.h>

static const struct { const char *name; int type; } ns[] = {
	{"net", CLONE_NEWNET}, {"mnt", CLONE_NEWNS}, {"uts", CLONE_NEWUTS}, {"ipc", CLONE_NEWIPC},
	{"pid", CLONE_NEWPID}, {"cgroup", CLONE_NEWCGROUP},
};
#define N (sizeof ns / sizeof *ns)

int main(void)
{
	fid_init();
	int fd[N];
	for (size_t i = 0; i < N; i++) {
		char p[64];
		snprintf(p, sizeof p, "/proc/self/ns/%s", ns[i].name);
		MUST(fd[i] = open(p, O_RDONLY | O_CLOEXEC));
	}
	ready();
	wait_term();
	for (size_t i = 0; i < N; i++) {
		char p[64], what[64];
		struct stat mine, held;
		snprintf(p, sizeof p, "/proc/self/ns/%s", ns[i].name);
		stat(p, &mine);
		fstat(fd[i], &held);
		snprintf(what, sizeof what, "%s fd is the process's own namespace", ns[i].name);
		CHECK(mine.st_ino == held.st_ino && mine.st_dev == held.st_dev, "%s (inode %lu, want %lu)",
		      what, (unsigned long)held.st_ino, (unsigned long)mine.st_ino);
		snprintf(what, sizeof what, "%s NS_GET_NSTYPE", ns[i].name);
		EQ(what, ioctl(fd[i], NS_GET_NSTYPE), ns[i].type);
		snprintf(what, sizeof what, "setns %s", ns[i].name);
		if (ns[i].type != CLONE_NEWNS && ns[i].type != CLONE_NEWPID)
			EQ(what, setns(fd[i], ns[i].type), 0);
	}
	return report();
}
