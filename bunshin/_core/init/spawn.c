/* Launching a tool call: fork, wire its descriptors, exec; report exec failures through a
 * close-on-exec pipe so the trainer gets an errno rather than a mysterious exit 127. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "init.h"

#define DEFAULT_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

struct spawn_args {
	const char *cwd;
	char **argv;
	char **envp;
	int as_user; /* 0: the init's own ids (root) */
	struct bx_user user;
	gid_t groups[BX_MAX_GROUPS];
};

/* The struct bx_user at the start of `buf` and its groups; returns the bytes they take, or -1. */
static ssize_t parse_user(const char *buf, size_t len, struct spawn_args *a)
{
	struct bx_user u;
	if (len < sizeof(u))
		return -1;
	memcpy(&u, buf, sizeof(u));
	size_t need = sizeof(u) + (size_t)u.ngroups * sizeof(uint32_t);
	if (u.ngroups > BX_MAX_GROUPS || len < need)
		return -1;
	for (uint32_t i = 0; i < u.ngroups; i++) {
		uint32_t g;
		memcpy(&g, buf + sizeof(u) + i * sizeof(g), sizeof(g));
		a->groups[i] = g;
	}
	a->user = u;
	a->as_user = 1;
	return need;
}

/* Groups first, then gid, then uid: each later step needs the power the earlier ones drop. */
static int become_user(const struct spawn_args *a)
{
	const struct bx_user *u = &a->user;
	if (syscall(SYS_setgroups, u->ngroups, a->groups) || syscall(SYS_setresgid, u->gid, u->gid, u->gid) ||
	    syscall(SYS_setresuid, u->uid, u->uid, u->uid))
		return -1;
	return 0;
}

/* Splits "cwd\0argv...\0env...\0" into pointers inside `buf` (which must stay alive). */
static int parse_strings(const struct bx_spawn *h, char *buf, size_t len, struct spawn_args *a)
{
	if (h->argc == 0 || h->argc > 1u << 20 || h->envc > 1u << 20)
		return -1;
	a->argv = calloc(h->argc + 1, sizeof(char *));
	a->envp = calloc(h->envc + 1, sizeof(char *));
	if (!a->argv || !a->envp)
		return -1;
	size_t need = 1 + h->argc + h->envc, got = 0;
	char *p = buf, *end = buf + len;
	while (got < need && p < end) {
		char *z = memchr(p, 0, end - p);
		if (!z)
			return -1;
		if (got == 0)
			a->cwd = p;
		else if (got <= h->argc)
			a->argv[got - 1] = p;
		else
			a->envp[got - 1 - h->argc] = p;
		got++;
		p = z + 1;
	}
	return got == need ? 0 : -1;
}

/* execvpe() searches the PATH of *our* environment; a tool call's PATH is in envp. */
static void exec_search(char **argv, char **envp)
{
	const char *file = argv[0];
	if (strchr(file, '/')) {
		execve(file, argv, envp);
		return;
	}
	const char *path = DEFAULT_PATH;
	for (char **e = envp; *e; e++)
		if (!strncmp(*e, "PATH=", 5))
			path = *e + 5;
	int saved = ENOENT;
	char buf[4096];
	for (const char *p = path; *p;) {
		const char *colon = strchrnul(p, ':');
		size_t dl = colon - p;
		if (dl + strlen(file) + 2 <= sizeof(buf)) {
			memcpy(buf, p, dl);
			buf[dl] = '/';
			strcpy(buf + dl + 1, file);
			const char *cand = dl ? buf : file;
			execve(cand, argv, envp);
			if (errno != ENOENT && errno != ENOTDIR)
				saved = errno;
		}
		p = *colon ? colon + 1 : colon;
	}
	errno = saved;
}

static void child(const struct bx_msg *m, const struct bx_spawn *h, const struct spawn_args *a,
		  int *fds, int errpipe)
{
	int report[2];
	sigset_t none;
	struct sigaction dfl;
	memset(&dfl, 0, sizeof(dfl));
	dfl.sa_handler = SIG_DFL;
	for (int s = 1; s < 65; s++)
		sigaction(s, &dfl, NULL); /* init ignores some; a tool call must not inherit that */
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);

	if (m->flags & BX_SPAWN_SETSID)
		setsid();
	/* fds[] are >= 3 (received after init's own 0-2), so dup2 cannot clobber a source. */
	for (int i = 0; i < 3; i++) {
		if (fds[i] >= 0 && dup2(fds[i], i) < 0) {
			report[0] = BX_STEP_FDS;
			goto fail;
		}
	}
	if ((m->flags & BX_SPAWN_CTTY) && ioctl(0, TIOCSCTTY, 0)) {
		report[0] = BX_STEP_CTTY;
		goto fail;
	}
	umask(h->umask & 0777);
	/* as root, so a working directory only its owner may enter is still entered (runc's order) */
	if (a->cwd[0] && chdir(a->cwd)) {
		report[0] = BX_STEP_CHDIR;
		goto fail;
	}
	if (a->as_user && become_user(a)) {
		report[0] = BX_STEP_USER;
		goto fail;
	}
	syscall(SYS_close_range, 3, ~0U, 4 /* CLOSE_RANGE_CLOEXEC */);
	exec_search(a->argv, a->envp);
	report[0] = BX_STEP_EXEC;
fail:
	report[1] = errno;
	(void)!write(errpipe, report, sizeof(report));
	_exit(127);
}

void spawn_request(const struct bx_msg *m, const char *payload, size_t plen, int *fds, int nfds,
		   struct spawned_info *out)
{
	struct spawn_args a = {0};
	struct bx_spawn h;
	char *buf = NULL;
	int p[2] = {-1, -1}, io[3] = {-1, -1, -1};

	memset(out, 0, sizeof(*out));
	if (plen < sizeof(h)) {
		out->err = EINVAL;
		return;
	}
	memcpy(&h, payload, sizeof(h));
	buf = malloc(plen - sizeof(h) + 1);
	if (!buf) {
		out->err = ENOMEM;
		return;
	}
	memcpy(buf, payload + sizeof(h), plen - sizeof(h));
	buf[plen - sizeof(h)] = 0;
	ssize_t skip = 0;
	if ((m->flags & BX_SPAWN_USER) && (skip = parse_user(buf, plen - sizeof(h), &a)) < 0) {
		out->err = EINVAL;
		goto done;
	}
	if (parse_strings(&h, buf + skip, plen - sizeof(h) - skip, &a)) {
		out->err = EINVAL;
		goto done;
	}
	for (int i = 0; i < 3 && i < nfds; i++)
		io[i] = fds[i];
	if (pipe2(p, O_CLOEXEC)) {
		out->err = errno;
		out->step = BX_STEP_FORK;
		goto done;
	}
	pid_t pid = fork();
	if (pid < 0) {
		out->err = errno;
		out->step = BX_STEP_FORK;
		goto done;
	}
	if (pid == 0)
		child(m, &h, &a, io, p[1]);
	close(p[1]);
	p[1] = -1;
	int report[2];
	ssize_t n;
	do
		n = read(p[0], report, sizeof(report));
	while (n < 0 && errno == EINTR);
	out->pid = pid;
	if (n == (ssize_t)sizeof(report)) {
		out->step = report[0];
		out->err = report[1];
	}
done:
	if (p[0] >= 0)
		close(p[0]);
	if (p[1] >= 0)
		close(p[1]);
	free(a.argv);
	free(a.envp);
	free(buf);
}
