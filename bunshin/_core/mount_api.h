#ifndef BUNSHIN_MOUNT_API_H
#define BUNSHIN_MOUNT_API_H
#include <stddef.h>
/* An overlay (lowers topmost first) as a detached mount; returns its fd or -errno, and on
 * failure leaves the file system's own messages (the fs context log) in msg. */
int bx_overlay_mount_fd(const char *const *lowers, int nlowers, const char *upper, const char *work,
			char *msg, size_t msglen);
#endif
