/* The sandbox's container-runtime defaults (bunshin/sandbox/__init__.py decides them and hands
 * them over in the init's environment): masked and read-only paths of each /proc and /sys the
 * init mounts, then, once, the capability sets and the seccomp filter. A forked init is a
 * clone of this one: it keeps the filter, the capabilities and what was read here, and masks
 * its own fresh /proc and /sys again. */
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "init.h"

static struct {
	int read, on, locked;
	uint64_t drop;
	struct sock_filter *prog;
	unsigned short len;
	char *mask, *ro, *rw;
} sb;

static char *take(const char *name)
{
	const char *v = getenv(name);
	char *s = v ? strdup(v) : NULL;
	unsetenv(name);
	return s;
}

static int unhex(int c)
{
	return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

static int read_env(char *err, size_t errlen)
{
	sb.read = 1;
	char *caps = take("BUNSHIN_SB_CAPS"), *bpf = take("BUNSHIN_SB_BPF");
	sb.mask = take("BUNSHIN_SB_MASK");
	sb.ro = take("BUNSHIN_SB_RO");
	sb.rw = take("BUNSHIN_SB_RW");
	if (!bpf)
		return 0;
	size_t n = strlen(bpf) / 2;
	if (!n || n % sizeof(struct sock_filter) || n / sizeof(struct sock_filter) > BPF_MAXINSNS ||
	    !(sb.prog = malloc(n))) {
		errno = EINVAL;
		FAIL("sandbox: a seccomp program of %zu bytes", n);
	}
	unsigned char *out = (unsigned char *)sb.prog;
	for (size_t i = 0; i < n; i++) {
		int hi = unhex(bpf[2 * i]), lo = unhex(bpf[2 * i + 1]);
		if (hi < 0 || lo < 0) {
			errno = EINVAL;
			FAIL("sandbox: the seccomp program is not hex");
		}
		out[i] = (unsigned char)(hi << 4 | lo);
	}
	sb.len = (unsigned short)(n / sizeof(struct sock_filter));
	sb.drop = caps ? strtoull(caps, NULL, 16) : 0;
	sb.on = 1;
	free(caps);
	free(bpf);
	return 0;
}

/* A bind remount must repeat the flags the mount has (locked ones in a user namespace). */
static unsigned long kept_flags(const char *path)
{
	struct statvfs s;
	unsigned long f = 0;
	if (statvfs(path, &s))
		return 0;
	if (s.f_flag & ST_NOSUID)
		f |= MS_NOSUID;
	if (s.f_flag & ST_NODEV)
		f |= MS_NODEV;
	if (s.f_flag & ST_NOEXEC)
		f |= MS_NOEXEC;
	return f;
}

/* Calls fn(root + path) for each path of a ':'-separated list. */
static int each(const char *root, const char *list, int (*fn)(const char *, const char *, char *, size_t),
		char *err, size_t errlen)
{
	char p[4096];
	for (const char *s = list; s && *s;) {
		const char *end = strchr(s, ':');
		size_t len = end ? (size_t)(end - s) : strlen(s);
		snprintf(p, sizeof(p), "%s%.*s", root, (int)len, s);
		if (fn(root, p, err, errlen))
			return -1;
		s = end ? end + 1 : s + len;
	}
	return 0;
}

static int bind_self(const char *root, const char *p, char *err, size_t errlen)
{
	(void)root;
	if (mount(p, p, NULL, MS_BIND | MS_REC, NULL))
		if (errno != ENOENT)
			FAIL("sandbox: bind %s", p);
	return 0;
}

static int read_only(const char *root, const char *p, char *err, size_t errlen)
{
	(void)root;
	if (mount(p, p, NULL, MS_BIND | MS_REC, NULL)) {
		if (errno == ENOENT)
			return 0;
		FAIL("sandbox: bind %s", p);
	}
	if (mount(NULL, p, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | kept_flags(p), NULL))
		FAIL("sandbox: make %s read-only", p);
	return 0;
}

static int mask(const char *root, const char *p, char *err, size_t errlen)
{
	struct stat st;
	char null[4096];
	if (stat(p, &st))
		return 0; /* not in this kernel */
	if (S_ISDIR(st.st_mode)) {
		if (mount("tmpfs", p, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=0,mode=555"))
			FAIL("sandbox: mask %s", p);
		return 0;
	}
	snprintf(null, sizeof(null), "%s/dev/null", root);
	if (mount(null, p, NULL, MS_BIND, NULL))
		FAIL("sandbox: mask %s", p);
	return 0;
}

static int lock_down(const char *root, char *err, size_t errlen)
{
	for (int cap = 0; cap < 64; cap++)
		if ((sb.drop >> cap & 1) && prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) && errno != EINVAL)
			FAIL("sandbox: drop capability %d from the bounding set", cap);
	struct __user_cap_header_struct h = {.version = _LINUX_CAPABILITY_VERSION_3};
	struct __user_cap_data_struct d[2];
	if (syscall(SYS_capget, &h, d))
		FAIL("sandbox: capget");
	for (int i = 0; i < 2; i++) {
		uint32_t keep = ~(uint32_t)(sb.drop >> (32 * i));
		d[i].effective &= keep;
		d[i].permitted &= keep;
		d[i].inheritable &= keep;
	}
	if (syscall(SYS_capset, &h, d))
		FAIL("sandbox: capset");
	prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
	struct sock_fprog prog = {.len = sb.len, .filter = sb.prog};
	if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0))
		FAIL("sandbox: load the seccomp filter");
	/* The init's stdio are host files (/dev/null, the state directory's init.log), which
	 * /proc/1/fd would hand to any process of the workspace: its own /dev/null instead (its
	 * setup is done; what fails later is reported over the control socket). */
	char null[4096];
	snprintf(null, sizeof(null), "%s/dev/null", root);
	int fd = open(null, O_RDWR | O_CLOEXEC);
	if (fd < 0)
		FAIL("sandbox: open %s", null);
	for (int i = 0; i < 3; i++)
		if (dup2(fd, i) < 0)
			FAIL("sandbox: stdio on %s", null);
	close(fd);
	sb.locked = 1;
	return 0;
}

int sandbox_apply(const char *root, char *err, size_t errlen)
{
	if (!sb.read && read_env(err, errlen))
		return -1;
	if (!sb.on)
		return 0;
	/* writable first: a read-only parent bound recursively keeps them as they are */
	if (each(root, sb.rw, bind_self, err, errlen) || each(root, sb.ro, read_only, err, errlen) ||
	    each(root, sb.mask, mask, err, errlen))
		return -1;
	return sb.locked ? 0 : lock_down(root, err, errlen);
}
