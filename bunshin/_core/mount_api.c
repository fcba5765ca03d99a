/* Detached overlay mounts (fsopen/fsconfig/fsmount): a forked workspace's root is built by the
 * trainer, which can see the host paths of the layers, and handed to the child's init as an fd. */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "mount_api.h"

#define FSOPEN_CLOEXEC 0x1
#define FSCONFIG_SET_STRING 1
#define FSCONFIG_CMD_CREATE 6
#define FSMOUNT_CLOEXEC 0x1

static int cfg(int fs, const char *key, const char *val)
{
	return (int)syscall(SYS_fsconfig, fs, FSCONFIG_SET_STRING, key, val, 0);
}

int bx_overlay_mount_fd(const char *const *lowers, int nlowers, const char *upper, const char *work)
{
	int fs = (int)syscall(SYS_fsopen, "overlay", FSOPEN_CLOEXEC), e = 0, mfd = -1;
	if (fs < 0)
		return -errno;
	/* "lowerdir+" (6.8+) takes one layer per call: no page-size limit on the layer list. */
	int plus = 1;
	for (int i = 0; i < nlowers && !e; i++) {
		if (cfg(fs, "lowerdir+", lowers[i])) {
			if (i == 0 && errno == EINVAL) {
				plus = 0;
				break;
			}
			e = -errno;
		}
	}
	if (!plus) {
		size_t len = 0;
		for (int i = 0; i < nlowers; i++)
			len += strlen(lowers[i]) + 1;
		char buf[len + 1], *p = buf;
		for (int i = 0; i < nlowers; i++)
			p += sprintf(p, i ? ":%s" : "%s", lowers[i]);
		if (cfg(fs, "lowerdir", buf))
			e = -errno;
	}
	if (!e && (cfg(fs, "upperdir", upper) || cfg(fs, "workdir", work)))
		e = -errno;
	if (!e && syscall(SYS_fsconfig, fs, FSCONFIG_CMD_CREATE, NULL, NULL, 0))
		e = -errno;
	if (!e && (mfd = (int)syscall(SYS_fsmount, fs, FSMOUNT_CLOEXEC, 0)) < 0)
		e = -errno;
	close(fs);
	return e ? e : mfd;
}
