/*
 * Bunshin's CRIU plugin: the workspace's external resources, dumped and restored by CRIU's
 * plugin hooks instead of `external` keys and `inherit_fd` descriptors in the RPC request.
 *
 * - The control socket. The init's end is a socketpair whose other end Bunshin holds (outside
 *   the dumped tree). CRIU asks the plugins about such a socket (DUMP_UNIX_SK); the one named
 *   by BUNSHIN_CRIU_CTL_INO is claimed, and CRIU marks it USK_CALLBACK in the image.
 * - The host files (the init's binary, its log, the host's /dev/null, files mapped from the
 *   workspace's own layers): regular files and devices on mounts outside the workspace. With
 *   Bunshin's ext-files patch (criu/patches) CRIU asks the plugins about such a file with the
 *   hooks it has for fds it cannot dump (DUMP_EXT_FILE); the ones named by device and inode in
 *   BUNSHIN_CRIU_FILES ("DEV:INO ...", what Bunshin found the workspace using) are claimed and
 *   recorded as external files. A stock CRIU never asks: Bunshin then names them `external`.
 *
 * Restore: BUNSHIN_CRIU_FDS names a unix stream socket on which Bunshin serves the fds; at
 * init the plugin connects and reads messages until Bunshin closes it, each "bunshin-criu-fds
 * 1" followed by one token per fd (SCM_RIGHTS): "unix:INO" for the socket dumped with that
 * inode, "file:ID" for the external file CRIU recorded with that id. Each fd goes into CRIU's
 * fd store, which every restored task can read (a task closes the fds it inherited from criu
 * before it opens its files); RESTORE_UNIX_SK and RESTORE_EXT_FILE hand out a copy.
 *
 * Without these variables the plugin claims nothing, and CRIU behaves as without it.
 */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include "criu_plugin_abi.h"

#define MAGIC "bunshin-criu-fds 1"
#define MAX_FDS 64     /* a message's; Bunshin sends more in more messages */
#define MAX_HANDED 4096
#define MEM_MAJOR 1    /* /dev/null, /dev/zero, ...: what CRIU dumps as regular files */

#define err(fmt, ...) print_on_level(BX_LOG_ERROR, "Error (bunshin-plugin): " fmt "\n", ##__VA_ARGS__)
#define info(fmt, ...) print_on_level(BX_LOG_INFO, "bunshin-plugin: " fmt "\n", ##__VA_ARGS__)

enum { HANDED_SOCKET, HANDED_FILE };

/* What Bunshin handed for a restore: a socket by its dumped inode, a file by its CRIU id */
static struct handed {
	int kind;
	unsigned long key;
	int store_id;
} *handed;
static int nr_handed;

/* A unix stream connection to the address in BUNSHIN_CRIU_FDS (a path, or @name abstract). */
static int connect_bunshin(const char *where)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	size_t n = strlen(where);
	socklen_t len;
	int sk;

	if (n == 0 || n >= sizeof(sa.sun_path)) {
		err("BUNSHIN_CRIU_FDS=%s: not a unix socket address", where);
		return -1;
	}
	memcpy(sa.sun_path, where, n);
	if (where[0] == '@')
		sa.sun_path[0] = '\0';
	len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n);
	sk = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (sk < 0) {
		err("socket: %s", strerror(errno));
		return -1;
	}
	if (connect(sk, (struct sockaddr *)&sa, len)) {
		err("cannot reach Bunshin at %s (BUNSHIN_CRIU_FDS): %s", where, strerror(errno));
		close(sk);
		return -1;
	}
	return sk;
}

/* One message: the tokens and their fds, each fd put in CRIU's fd store; 1 when Bunshin
 * closed the connection instead */
static int receive_fds(int sk)
{
	char body[4096], cbuf[CMSG_SPACE(sizeof(int) * MAX_FDS)];
	struct iovec iov = { .iov_base = body, .iov_len = sizeof(body) - 1 };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
			     .msg_controllen = sizeof(cbuf) };
	int fds[MAX_FDS], nfds = 0, i, ret = -1;
	struct cmsghdr *c;
	char *tok, *save;
	ssize_t got;

	got = recvmsg(sk, &mh, MSG_CMSG_CLOEXEC);
	if (got < 0) {
		err("recvmsg from Bunshin: %s", strerror(errno));
		return -1;
	}
	for (c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
		if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
			int n = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));

			if (nfds + n > MAX_FDS)  /* the control buffer holds no more: MSG_CTRUNC */
				n = MAX_FDS - nfds;
			memcpy(fds + nfds, CMSG_DATA(c), sizeof(int) * n);
			nfds += n;
		}
	}
	if (got == 0 && nfds == 0)
		return 1;
	body[got] = '\0';
	if (mh.msg_flags & (MSG_CTRUNC | MSG_TRUNC)) {
		err("Bunshin sent more than %d fds or %zu bytes in a message", MAX_FDS, sizeof(body) - 1);
		goto out;
	}
	tok = strtok_r(body, " \n", &save);
	if (!tok || strcmp(tok, "bunshin-criu-fds") || !(tok = strtok_r(NULL, " \n", &save)) ||
	    strcmp(tok, "1")) {
		err("Bunshin's message does not start with \"" MAGIC "\"");
		goto out;
	}
	for (i = 0; (tok = strtok_r(NULL, " \n", &save)); i++) {
		struct handed *h = &handed[nr_handed];
		char *end, *num;

		if (i >= nfds || nr_handed >= MAX_HANDED) {
			err("token %d (%s): no fd for it, or more than %d in all", i, tok, MAX_HANDED);
			goto out;
		}
		if (!strncmp(tok, "unix:", 5)) {
			h->kind = HANDED_SOCKET;
			num = tok + 5;
		} else if (!strncmp(tok, "file:", 5)) {
			h->kind = HANDED_FILE;
			num = tok + 5;
		} else {
			err("token %d (%s): neither unix:INO nor file:ID", i, tok);
			goto out;
		}
		h->key = strtoul(num, &end, 10);
		if (*end || end == num) {
			err("token %d (%s): not a number after the colon", i, tok);
			goto out;
		}
		h->store_id = fdstore_add(fds[i]);
		if (h->store_id < 0) {
			err("cannot keep the fd for %s in CRIU's fd store", tok);
			goto out;
		}
		nr_handed++;
	}
	if (i != nfds) {
		err("%d fds for %d tokens", nfds, i);
		goto out;
	}
	ret = 0;
out:
	for (i = 0; i < nfds; i++)
		close(fds[i]);
	return ret;
}

/* The device:inode pairs of BUNSHIN_CRIU_FILES, the files this plugin claims at a dump */
static struct devino {
	unsigned long long dev, ino;
} *claimed;
static int nr_claimed;

static int parse_claimed(const char *list)
{
	const char *p = list;
	int n = 1;

	for (; *p; p++)
		n += *p == ' ';
	claimed = calloc(n, sizeof(*claimed));
	if (!claimed) {
		err("out of memory for %d files", n);
		return -1;
	}
	for (p = list; *p;) {
		char *end;

		while (*p == ' ')
			p++;
		if (!*p)
			break;
		errno = 0;
		claimed[nr_claimed].dev = strtoull(p, &end, 10);
		if (end == p || *end != ':' || errno) {
			err("BUNSHIN_CRIU_FILES: \"%.40s\" is not DEV:INO", p);
			return -1;
		}
		p = end + 1;
		claimed[nr_claimed].ino = strtoull(p, &end, 10);
		if (end == p || (*end && *end != ' ') || errno) {
			err("BUNSHIN_CRIU_FILES: \"%.40s\" is not DEV:INO", p);
			return -1;
		}
		nr_claimed++;
		p = end;
	}
	info("%d host files to claim", nr_claimed);
	return 0;
}

static int bunshin_init(int stage)
{
	const char *where = getenv("BUNSHIN_CRIU_FDS");
	const char *files = getenv("BUNSHIN_CRIU_FILES");
	int sk, ret;

	nr_handed = nr_claimed = 0;
	if (stage == BX_STAGE_DUMP && files)
		return parse_claimed(files);
	if (stage != BX_STAGE_RESTORE || !where)
		return 0;
	handed = calloc(MAX_HANDED, sizeof(*handed));
	if (!handed) {
		err("out of memory");
		return -1;
	}
	sk = connect_bunshin(where);
	if (sk < 0)
		return -1;
	while ((ret = receive_fds(sk)) == 0)
		;
	close(sk);
	if (ret > 0)
		info("%d fds from Bunshin", nr_handed);
	return ret > 0 ? 0 : -1;
}

static void bunshin_exit(int stage, int ret)
{
	free(handed);
	free(claimed);
	handed = NULL;
	claimed = NULL;
	nr_handed = nr_claimed = 0;
}

static int bunshin_dump_unix_sk(int fd, int id)
{
	const char *ino = getenv("BUNSHIN_CRIU_CTL_INO");

	if (!ino || strtoul(ino, NULL, 10) != (unsigned long)(unsigned int)id)
		return -ENOTSUP;
	info("socket %u: the workspace's control socket, restored by this plugin", (unsigned int)id);
	return 0;
}

/* A copy of the fd Bunshin handed for (kind, key); -ENOTSUP when it handed none */
static int take(int kind, unsigned long key)
{
	int i;

	for (i = 0; i < nr_handed; i++)
		if (handed[i].kind == kind && handed[i].key == key)
			return fdstore_get(handed[i].store_id);
	if (!getenv("BUNSHIN_CRIU_FDS"))
		return -ENOTSUP;
	if (kind == HANDED_SOCKET)  /* as CRIU names them: a socket by its inode, a file by its id */
		err("socket %lu was dumped for this plugin, but Bunshin handed no fd for it", key);
	else
		err("file %#lx was dumped for this plugin, but Bunshin handed no fd for it", key);
	return -ENOTSUP;
}

static int bunshin_restore_unix_sk(int id)
{
	return take(HANDED_SOCKET, (unsigned int)id);
}

/*
 * fd is CRIU's descriptor of the file (or of the mapped one), id its id in the image. Only
 * what CRIU dumps as a regular file is claimed: regular files, directories and memory devices
 * (/dev/null, /dev/zero: MEM_MAJOR). CRIU also asks about fds of types it cannot dump at all
 * (other devices): those it would record as plugin-made files of another kind, which Bunshin
 * does not hand back, so they fail the dump here as on a stock CRIU.
 */
static int bunshin_dump_ext_file(int fd, int id)
{
	struct stat st;
	int i;

	if (!nr_claimed || fstat(fd, &st))
		return -ENOTSUP;
	if (!(S_ISREG(st.st_mode) || S_ISDIR(st.st_mode) ||
	      (S_ISCHR(st.st_mode) && major(st.st_rdev) == MEM_MAJOR)))
		return -ENOTSUP;
	for (i = 0; i < nr_claimed; i++)
		if (claimed[i].dev == (unsigned long long)st.st_dev &&
		    claimed[i].ino == (unsigned long long)st.st_ino) {
			info("file %#x (%llu:%llu): a host file of the workspace, handed back by Bunshin",
			     (unsigned int)id, claimed[i].dev, claimed[i].ino);
			return 0;
		}
	return -ENOTSUP;
}

static int bunshin_restore_ext_file(int id)
{
	return take(HANDED_FILE, (unsigned int)id);
}

__attribute__((visibility("default"))) bx_criu_plugin_desc_t CR_PLUGIN_DESC = {
	.name = "bunshin",
	.init = bunshin_init,
	.exit = bunshin_exit,
	.version = BX_CRIU_PLUGIN_VERSION,
	/* CRIU reads hooks[0 .. max_hooks): ours are the first four, which keeps the plugin
	 * loadable by a CRIU of fewer hooks than 4.2.1's (it refuses a larger max_hooks) */
	.max_hooks = BX_HOOK_RESTORE_EXT_FILE + 1,
	.hooks = {
		[BX_HOOK_DUMP_UNIX_SK] = (void *)bunshin_dump_unix_sk,
		[BX_HOOK_RESTORE_UNIX_SK] = (void *)bunshin_restore_unix_sk,
		[BX_HOOK_DUMP_EXT_FILE] = (void *)bunshin_dump_ext_file,
		[BX_HOOK_RESTORE_EXT_FILE] = (void *)bunshin_restore_ext_file,
	},
};
