/* Namespace-side setup of a workspace: private mounts, overlay root, /proc, /sys, /dev,
 * hostname, loopback, pivot_root. Runs once in the fresh namespaces, as PID 1. */
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>
#include "init.h"

static int write_file(const char *path, const char *s)
{
	int fd = open(path, O_WRONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t n = write(fd, s, strlen(s));
	int e = errno;
	close(fd);
	errno = e;
	return n == (ssize_t)strlen(s) ? 0 : -1;
}

static int mount_overlay(const struct setup_cfg *c, char *err, size_t errlen)
{
	char opts[4096];
	int n = snprintf(opts, sizeof(opts), "lowerdir=%s,upperdir=%s,workdir=%s", c->lower, c->upper,
			 c->work);
	if (n < 0 || (size_t)n >= sizeof(opts)) {
		errno = E2BIG;
		FAIL("overlay options too long (%d bytes; too many or too deep lower layers)", n);
	}
	if (mount("overlay", c->root, "overlay", 0, opts))
		FAIL("mount overlay on %s (%s)", c->root, opts);
	return 0;
}

struct devnode {
	const char *name;
	unsigned maj, min;
};

static const struct devnode devnodes[] = {
	{"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7}, {"random", 1, 8}, {"urandom", 1, 9}, {"tty", 5, 0},
};

static const char *const devlinks[][2] = {
	{"/proc/self/fd", "fd"},     {"/proc/self/fd/0", "stdin"}, {"/proc/self/fd/1", "stdout"},
	{"/proc/self/fd/2", "stderr"}, {"pts/ptmx", "ptmx"},
};

static int mount_dev(const char *root, char *err, size_t errlen)
{
	char p[4096];
	snprintf(p, sizeof(p), "%s/dev", root);
	mkdir(p, 0755);
	if (mount("tmpfs", p, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=65536k"))
		FAIL("mount tmpfs on %s", p);
	for (size_t i = 0; i < sizeof(devnodes) / sizeof(devnodes[0]); i++) {
		snprintf(p, sizeof(p), "%s/dev/%s", root, devnodes[i].name);
		if (mknod(p, S_IFCHR | 0666, makedev(devnodes[i].maj, devnodes[i].min)) == 0) {
			chmod(p, 0666); /* mknod obeys the umask */
			continue;
		}
		/* In a user namespace of its own a workspace may not make device nodes (and a
		 * tmpfs mounted there opens none): bind the current root's node instead. */
		if (errno != EPERM)
			FAIL("mknod %s", p);
		char src[64];
		snprintf(src, sizeof(src), "/dev/%s", devnodes[i].name);
		int fd = open(p, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
		if (fd < 0)
			FAIL("create %s", p);
		close(fd);
		if (mount(src, p, NULL, MS_BIND, NULL))
			FAIL("bind %s on %s", src, p);
	}
	for (size_t i = 0; i < sizeof(devlinks) / sizeof(devlinks[0]); i++) {
		snprintf(p, sizeof(p), "%s/dev/%s", root, devlinks[i][1]);
		if (symlink(devlinks[i][0], p))
			FAIL("symlink %s", p);
	}
	snprintf(p, sizeof(p), "%s/dev/pts", root);
	mkdir(p, 0755);
	if (mount("devpts", p, "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620"))
		FAIL("mount devpts on %s", p);
	snprintf(p, sizeof(p), "%s/dev/shm", root);
	mkdir(p, 01777);
	if (mount("shm", p, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777"))
		FAIL("mount tmpfs on %s", p);
	snprintf(p, sizeof(p), "%s/dev/mqueue", root);
	mkdir(p, 0755);
	if (mount("mqueue", p, "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL))
		FAIL("mount mqueue on %s", p);
	return 0;
}

int loopback_up(char *err, size_t errlen)
{
	int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (s < 0)
		FAIL("socket for lo");
	struct ifreq ifr;
	memset(&ifr, 0, sizeof(ifr));
	strcpy(ifr.ifr_name, "lo");
	if (ioctl(s, SIOCGIFFLAGS, &ifr) == 0) {
		ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
		if (ioctl(s, SIOCSIFFLAGS, &ifr)) {
			close(s);
			FAIL("bring lo up");
		}
	}
	close(s);
	return 0;
}

int setup_workspace(const struct setup_cfg *c, char *err, size_t errlen)
{
	char p[4096];

	/* Nothing we mount may propagate back to the host. */
	if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL))
		FAIL("make / private");
	for (int i = 0; i < c->ncgroups; i++)
		if (write_file(c->cgroups[i], "0"))
			FAIL("join cgroup %s", c->cgroups[i]);
	if (!c->root)
		return 0;
	if (mount_overlay(c, err, errlen))
		return -1;
	if (mount_submounts(c->root, err, errlen))
		return -1;
	if (c->hostname && sethostname(c->hostname, strlen(c->hostname)))
		FAIL("sethostname %s", c->hostname);
	if (loopback_up(err, errlen))
		return -1;
	return pivot_into(c->root, err, errlen);
}

/* The file systems every workspace root gets fresh: they belong to its pid, net and ipc
 * namespaces, so they are mounted from inside, never inherited. */
int mount_submounts(const char *root, char *err, size_t errlen)
{
	char p[4096];
	snprintf(p, sizeof(p), "%s/proc", root);
	mkdir(p, 0555);
	if (mount("proc", p, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL))
		FAIL("mount proc on %s", p);
	snprintf(p, sizeof(p), "%s/sys", root);
	mkdir(p, 0555);
	if (mount("sysfs", p, "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL))
		FAIL("mount sysfs on %s", p);
	if (mount_dev(root, err, errlen))
		return -1;
	snprintf(p, sizeof(p), "%s/tmp", root);
	mkdir(p, 01777);
	return sandbox_apply(root, err, errlen);
}

/* pivot_root(".", ".") stacks the old root under the new one; detaching it leaves the
 * previous tree (the host's, or a template's) unreachable from inside. */
int pivot_into(const char *root, char *err, size_t errlen)
{
	if (chdir(root))
		FAIL("chdir %s", root);
	if (syscall(SYS_pivot_root, ".", "."))
		FAIL("pivot_root %s", root);
	if (umount2(".", MNT_DETACH))
		FAIL("detach old root");
	if (chdir("/"))
		FAIL("chdir /");
	return 0;
}

/* A forked init starts in a copy of its template's mount namespace, whose root is the
 * template's overlay. The trainer built the child's overlay as a detached mount (mfd): attach
 * it, give it fresh /proc, /sys and /dev from the child's namespaces, and pivot into it. */
int reroot_after_fork(int mfd, const int *nsfds, const char *hostname, char *err, size_t errlen)
{
	static const struct {
		int type;
		const char *name;
	} ns[] = {{CLONE_NEWNET, "net"}, {CLONE_NEWIPC, "ipc"}, {CLONE_NEWUTS, "uts"}};

	if (syscall(SYS_move_mount, mfd, "", AT_FDCWD, "/proc", 0x4 /* MOVE_MOUNT_F_EMPTY_PATH */))
		FAIL("attach the child's root");
	if (fchdir(mfd))
		FAIL("enter the child's root");
	/* Namespaces made ahead of the fork (the trainer's pool): joined before /sys and mqueue
	 * are mounted, since those belong to the net and ipc namespace of whoever mounts them. */
	for (size_t i = 0; nsfds && i < sizeof(ns) / sizeof(ns[0]); i++)
		if (setns(nsfds[i], ns[i].type))
			FAIL("join the %s namespace made for this fork", ns[i].name);
	if (mount_submounts(".", err, errlen))
		return -1;
	if (hostname && *hostname && sethostname(hostname, strlen(hostname)))
		FAIL("sethostname %s", hostname);
	if (loopback_up(err, errlen))
		return -1;
	return pivot_into(".", err, errlen);
}
