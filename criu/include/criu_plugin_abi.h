/*
 * The CRIU plugin ABI as CRIU 4.2.1 loads it (criu/plugin.c), declared here rather than
 * copied: CRIU's own criu-plugin.h is GPL-2.0-or-later, this project Apache-2.0, and a plugin
 * needs only the layout of its descriptor, the hook numbers and the few exported functions it
 * calls. Checked against criu-4.2.1/criu/include/criu-plugin.h (Debian's criu_4.2.1.orig.tar).
 *
 * CRIU refuses a descriptor whose version is above its own CRIU_PLUGIN_VERSION or whose
 * max_hooks exceeds its CR_PLUGIN_HOOK__MAX: 0.2.0 and 13 are 4.2.1's (0.2.0 since CRIU 3.x).
 */
#ifndef BUNSHIN_CRIU_PLUGIN_ABI_H
#define BUNSHIN_CRIU_PLUGIN_ABI_H

#define BX_CRIU_PLUGIN_VERSION ((0 << 16) + (2 << 8) + 0)

enum {
	BX_HOOK_DUMP_UNIX_SK = 0,     /* int (int fd, int id): 0 = this external socket is mine */
	BX_HOOK_RESTORE_UNIX_SK = 1,  /* int (int id): an fd for that socket, or -ENOTSUP */
	BX_HOOK_DUMP_EXT_FILE = 2,    /* int (int fd, int id): 0 = this file is mine; with criu/patches
				       also a regular file on a mount outside the tree */
	BX_HOOK_RESTORE_EXT_FILE = 3, /* int (int id): an fd for that file, or -ENOTSUP */
	BX_HOOK_DUMP_EXT_MOUNT = 4,
	BX_HOOK_RESTORE_EXT_MOUNT = 5,
	BX_HOOK_DUMP_EXT_LINK = 6,
	BX_HOOK_HANDLE_DEVICE_VMA = 7,
	BX_HOOK_UPDATE_VMA_MAP = 8,
	BX_HOOK_RESUME_DEVICES_LATE = 9,
	BX_HOOK_PAUSE_DEVICES = 10,
	BX_HOOK_CHECKPOINT_DEVICES = 11,
	BX_HOOK_POST_FORKING = 12,
	BX_HOOK_MAX = 13
};

enum { BX_STAGE_DUMP = 0, BX_STAGE_PRE_DUMP = 1, BX_STAGE_RESTORE = 2 };

/* CRIU's cr_plugin_desc_t; CRIU dlsym()s it by the name CR_PLUGIN_DESC */
typedef struct {
	const char *name;
	int (*init)(int stage);
	void (*exit)(int stage, int ret);
	unsigned int version;
	unsigned int max_hooks;
	void *hooks[BX_HOOK_MAX];
} bx_criu_plugin_desc_t;

/* Exported by the criu binary (linked -rdynamic); resolved when CRIU dlopen()s the plugin */
extern void print_on_level(unsigned int loglevel, const char *format, ...)
	__attribute__((format(printf, 2, 3)));
extern int fdstore_add(int fd);  /* keeps fd in CRIU's fd store (a service socket every
				    restored task can read); returns its id */
extern int fdstore_get(int id);  /* a new fd for that id */

#define BX_LOG_ERROR 1
#define BX_LOG_INFO 3

#endif
