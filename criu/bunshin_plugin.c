/*
 * Bunshin's CRIU plugin: the workspace's control socket, dumped and restored by CRIU's
 * unix-socket hooks instead of an `external` unix[ino] and an `inherit_fd` in the RPC request.
 *
 * Dump: the init's end of the control socket is a socketpair whose other end Bunshin holds
 * (outside the dumped tree). CRIU asks the plugins about such a socket (DUMP_UNIX_SK); the one
 * named by BUNSHIN_CRIU_CTL_INO is claimed, and CRIU marks it USK_CALLBACK in the image.
 *
 * Restore: BUNSHIN_CRIU_FDS names a unix stream socket on which Bunshin serves the fds; at
 * init the plugin connects and receives one message, "bunshin-criu-fds 1" followed by one
 * "unix:INO" token per fd (SCM_RIGHTS). Each fd goes into CRIU's fd store, which every
 * restored task can read (a task closes the fds it inherited from criu before it opens its
 * files); RESTORE_UNIX_SK hands out a copy for the socket whose inode it was dumped with.
 *
 * Without either variable the plugin claims nothing, and CRIU behaves as without it.
 */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "criu_plugin_abi.h"

#define MAGIC "bunshin-criu-fds 1"
#define MAX_FDS 16

#define err(fmt, ...) print_on_level(BX_LOG_ERROR, "Error (bunshin-plugin): " fmt "\n", ##__VA_ARGS__)
#define info(fmt, ...) print_on_level(BX_LOG_INFO, "bunshin-plugin: " fmt "\n", ##__VA_ARGS__)

static struct {
	unsigned long ino;
	int store_id;
} handed[MAX_FDS];
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

/* One message: the tokens and their fds; each fd is put in CRIU's fd store. */
static int receive_fds(int sk)
{
	char body[1024], cbuf[CMSG_SPACE(sizeof(int) * MAX_FDS)];
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
			nfds = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
			memcpy(fds, CMSG_DATA(c), sizeof(int) * nfds);
		}
	}
	body[got] = '\0';
	if (mh.msg_flags & (MSG_CTRUNC | MSG_TRUNC)) {
		err("Bunshin sent more than %d fds or %zu bytes", MAX_FDS, sizeof(body) - 1);
		goto out;
	}
	tok = strtok_r(body, " \n", &save);
	if (!tok || strcmp(tok, "bunshin-criu-fds") || !(tok = strtok_r(NULL, " \n", &save)) ||
	    strcmp(tok, "1")) {
		err("Bunshin's message does not start with \"" MAGIC "\"");
		goto out;
	}
	for (i = 0; (tok = strtok_r(NULL, " \n", &save)); i++) {
		char *end;

		if (i >= nfds || strncmp(tok, "unix:", 5)) {
			err("token %d (%s): no fd for it, or not unix:INO", i, tok);
			goto out;
		}
		handed[i].ino = strtoul(tok + 5, &end, 10);
		if (*end) {
			err("token %d (%s): not unix:INO", i, tok);
			goto out;
		}
		handed[i].store_id = fdstore_add(fds[i]);
		if (handed[i].store_id < 0) {
			err("cannot keep the fd for %s in CRIU's fd store", tok);
			goto out;
		}
		info("socket %lu from Bunshin (fd store id %d)", handed[i].ino, handed[i].store_id);
	}
	if (i != nfds) {
		err("%d fds for %d tokens", nfds, i);
		goto out;
	}
	nr_handed = nfds;
	ret = 0;
out:
	for (i = 0; i < nfds; i++)
		close(fds[i]);
	return ret;
}

static int bunshin_init(int stage)
{
	const char *where = getenv("BUNSHIN_CRIU_FDS");
	int sk, ret;

	nr_handed = 0;
	if (stage != BX_STAGE_RESTORE || !where)
		return 0;
	sk = connect_bunshin(where);
	if (sk < 0)
		return -1;
	ret = receive_fds(sk);
	close(sk);
	return ret;
}

static void bunshin_exit(int stage, int ret)
{
}

static int bunshin_dump_unix_sk(int fd, int id)
{
	const char *ino = getenv("BUNSHIN_CRIU_CTL_INO");

	if (!ino || strtoul(ino, NULL, 10) != (unsigned long)(unsigned int)id)
		return -ENOTSUP;
	info("socket %u: the workspace's control socket, restored by this plugin", (unsigned int)id);
	return 0;
}

static int bunshin_restore_unix_sk(int id)
{
	int i;

	for (i = 0; i < nr_handed; i++)
		if (handed[i].ino == (unsigned long)(unsigned int)id)
			return fdstore_get(handed[i].store_id);
	if (getenv("BUNSHIN_CRIU_FDS"))
		err("socket %u was dumped for this plugin, but Bunshin handed no fd for it", (unsigned int)id);
	return -ENOTSUP;
}

__attribute__((visibility("default"))) bx_criu_plugin_desc_t CR_PLUGIN_DESC = {
	.name = "bunshin",
	.init = bunshin_init,
	.exit = bunshin_exit,
	.version = BX_CRIU_PLUGIN_VERSION,
	/* CRIU reads hooks[0 .. max_hooks): ours are the first two, which keeps the plugin
	 * loadable by a CRIU of fewer hooks than 4.2.1's (it refuses a larger max_hooks) */
	.max_hooks = BX_HOOK_RESTORE_UNIX_SK + 1,
	.hooks = {
		[BX_HOOK_DUMP_UNIX_SK] = (void *)bunshin_dump_unix_sk,
		[BX_HOOK_RESTORE_UNIX_SK] = (void *)bunshin_restore_unix_sk,
	},
};
