#ifndef BUNSHIN_MOUNT_API_H
#define BUNSHIN_MOUNT_API_H
/* An overlay (lowers topmost first) as a detached mount; returns its fd or -errno. */
int bx_overlay_mount_fd(const char *const *lowers, int nlowers, const char *upper, const char *work);
#endif
