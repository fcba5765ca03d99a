/* Detached overlay mounts (fsopen/fsconfig/fsmount): a forked workspace's root is built by the
 * trainer, which can see the host paths of the layers, and handed to the child's init as an fd. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "mount_api.h"

#define FSOPEN_CLOEXEC 0x1
#define FSCONFIG_SET_STRING 1
#define FSCONFIG_CMD_CREATE 6
#define FSMOUNT_CLOEXEC 0x1
#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#define OPEN_TREE_CLONE 1
#define OPEN_TREE_CLOEXEC O_CLOEXEC
/* fsconfig(FSCONFIG_SET_STRING) copies at most 255 bytes of a value */
#define FSCONFIG_MAX_STRING 255

static int cfg(int fs, const char *key, const char *val)
{
	return (int)syscall(SYS_fsconfig, fs, FSCONFIG_SET_STRING, key, val, 0);
}

static char *join_lowers(const char *const *lowers, int nlowers)
{
	size_t len = 1;
	for (int i = 0; i < nlowers; i++)
		len += strlen(lowers[i]) + 1;
	char *buf = malloc(len), *p = buf;
	if (!buf)
		return NULL;
	*p = 0;
	for (int i = 0; i < nlowers; i++)
		p += sprintf(p, i ? ":%s" : "%s", lowers[i]);
	return buf;
}

/*
 * Kernels before 6.8 have no "lowerdir+", and fsconfig takes at most 255 bytes of
 * "lowerdir": a longer layer list goes through mount(2) (a page of options) on a scratch
 * directory next to @work, whose mount is then cloned detached (open_tree) and unmounted.
 */
static int overlay_mount2(const char *const *lowers, int nlowers, const char *upper,
			  const char *work, char *msg, size_t msglen)
{
	char *joined = join_lowers(lowers, nlowers), *data = NULL, *dir = NULL;
	int e = -ENOMEM, fd = -1;

	if (!joined)
		goto out;
	if (asprintf(&data, "lowerdir=%s,upperdir=%s,workdir=%s", joined, upper, work) < 0 ||
	    asprintf(&dir, "%s.mnt", work) < 0) {
		data = dir = NULL;
		goto out;
	}
	if (mkdir(dir, 0700) && errno != EEXIST) {
		e = -errno;
		goto out;
	}
	if (mount("overlay", dir, "overlay", 0, data)) {
		e = -errno;
		snprintf(msg, msglen, "mount(2) with %zu bytes of options", strlen(data));
	} else {
		fd = (int)syscall(SYS_open_tree, AT_FDCWD, dir, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
		e = fd < 0 ? -errno : 0;
		umount2(dir, MNT_DETACH);
	}
	rmdir(dir);
out:
	free(joined);
	free(data);
	free(dir);
	return e ? e : fd;
}

/* One attempt: "lowerdir+" (6.8+) takes one layer per call, with no limit on the layer
 * list; "lowerdir" takes them all, joined by ':'. */
/* The fs context's log ("e ..." lines), joined by "; " into msg. */
static void read_log(int fs, char *msg, size_t msglen)
{
	char line[512];
	size_t used = 0;
	ssize_t n;

	msg[0] = 0;
	while ((n = read(fs, line, sizeof(line) - 1)) > 0) {
		line[n] = 0;
		if (n > 2 && line[1] == ' ')  /* "e ", "w ", "i " prefixes */
			used += snprintf(msg + used, msglen - used, "%s%s", used ? "; " : "", line + 2);
		if (used >= msglen - 1)
			break;
	}
}

static int overlay_try(const char *const *lowers, int nlowers, const char *upper, const char *work,
		       int plus, char *msg, size_t msglen)
{
	int fs = (int)syscall(SYS_fsopen, "overlay", FSOPEN_CLOEXEC), e = 0, mfd = -1;
	if (fs < 0)
		return -errno;
	if (plus) {
		for (int i = 0; i < nlowers && !e; i++)
			if (cfg(fs, "lowerdir+", lowers[i]))
				e = -errno;
	} else {
		char *joined = join_lowers(lowers, nlowers);
		if (!joined)
			e = -ENOMEM;
		else if (cfg(fs, "lowerdir", joined))
			e = -errno;
		free(joined);
	}
	if (!e && (cfg(fs, "upperdir", upper) || cfg(fs, "workdir", work)))
		e = -errno;
	if (!e && syscall(SYS_fsconfig, fs, FSCONFIG_CMD_CREATE, NULL, NULL, 0))
		e = -errno;
	if (!e && (mfd = (int)syscall(SYS_fsmount, fs, FSMOUNT_CLOEXEC, 0)) < 0)
		e = -errno;
	if (e)
		read_log(fs, msg, msglen);
	close(fs);
	return e ? e : mfd;
}

int bx_overlay_mount_fd(const char *const *lowers, int nlowers, const char *upper, const char *work,
			char *msg, size_t msglen)
{
	/* Before 6.5 overlayfs parses options only at CMD_CREATE (legacy mount data), so an
	 * unknown "lowerdir+" shows up there, as EINVAL: then the joined list is tried. */
	/* learned once per process, so the kernel log gets one "unrecognized" line, not one
	 * per fork */
	static int no_plus;
	int r = __atomic_load_n(&no_plus, __ATOMIC_RELAXED) ? -EINVAL : overlay_try(lowers, nlowers, upper, work, 1, msg, msglen);
	if (r == -EINVAL) {
		char *joined = join_lowers(lowers, nlowers);
		size_t len = joined ? strlen(joined) : 0;
		free(joined);
		msg[0] = 0;
		r = len <= FSCONFIG_MAX_STRING ? overlay_try(lowers, nlowers, upper, work, 0, msg, msglen)
					      : overlay_mount2(lowers, nlowers, upper, work, msg, msglen);
		if (r >= 0)
			__atomic_store_n(&no_plus, 1, __ATOMIC_RELAXED);
	}
	return r;
}
