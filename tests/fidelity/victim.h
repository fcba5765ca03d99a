/* What every fidelity victim shares: it sets up one kind of process state, calls ready(),
 * blocks in wait_term() until SIGTERM, checks the state with CHECK/EQ and ends with report(),
 * which writes "PASS" or one line per difference to /tmp/fid-verdict (renamed into place, so
 * a reader never sees it half written). SIGTERM is blocked from the start (fid_init, called
 * before any thread or child exists) so that it is only ever taken by wait_term(). */
#define _GNU_SOURCE
#pragma GCC diagnostic ignored "-Wunused-function"  /* each victim uses a few helpers */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/stat.h>
#include <sys/types.h>

#ifndef SS_AUTODISARM
#define SS_AUTODISARM (1U << 31)
#endif

static char fid_out[16384];
static size_t fid_len;

static pthread_mutex_t fid_lock = PTHREAD_MUTEX_INITIALIZER;  /* threads check at once */

static void fid_say(const char *fmt, ...)
{
	va_list ap;
	pthread_mutex_lock(&fid_lock);
	va_start(ap, fmt);
	int n = vsnprintf(fid_out + fid_len, sizeof fid_out - fid_len - 1, fmt, ap);
	va_end(ap);
	if (n > 0 && fid_len + n < sizeof fid_out - 2) {
		fid_len += n;
		fid_out[fid_len++] = '\n';
	}
	pthread_mutex_unlock(&fid_lock);
}

/* Lines another process of the victim reported (each ending with a newline), as ours. */
static void fid_append(const char *lines)
{
	size_t n = strlen(lines);
	if (fid_len + n < sizeof fid_out - 1) {
		memcpy(fid_out + fid_len, lines, n);
		fid_len += n;
	}
}

#define CHECK(cond, ...) do { if (!(cond)) fid_say(__VA_ARGS__); } while (0)
#define EQ(what, got, want) do { long long g_ = (long long)(got), w_ = (long long)(want); \
	CHECK(g_ == w_, "%s: %lld, want %lld", what, g_, w_); } while (0)
#define NEAR(what, got, want, tol) do { double g_ = (got), w_ = (want); \
	CHECK(g_ >= w_ - (tol) && g_ <= w_ + (tol), "%s: %.3f, want %.3f ± %.3f", what, g_, w_, (double)(tol)); } while (0)
#define CHAREQ(what, got, want) do { char g_ = (got), w_ = (want); \
	CHECK(g_ == w_, "%s: '%c', want '%c'", what, g_, w_); } while (0)
#define STREQ(what, got, want) do { const char *g_ = (got), *w_ = (want); \
	CHECK(g_ && !strcmp(g_, w_), "%s: '%s', want '%s'", what, g_ ? g_ : "(null)", w_); } while (0)
/* A setup step that fails is the victim's own fault: say so and stop, never report READY. */
#define MUST(x) do { if ((long)(x) == -1) { fprintf(stderr, "setup: %s: %s\n", #x, strerror(errno)); exit(2); } } while (0)

static void put_file(const char *path, const char *text)
{
	char tmp[256];
	snprintf(tmp, sizeof tmp, "%s.part", path);
	int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text) || close(fd) || rename(tmp, path)) {
		perror(path);
		exit(3);
	}
}

static void fid_init(void)
{
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, SIGTERM);
	sigprocmask(SIG_BLOCK, &s, 0);
}

static void ready(void) { put_file("/tmp/fid-ready", "READY\n"); }

static void wait_term(void)
{
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, SIGTERM);
	while (sigwaitinfo(&s, 0) != SIGTERM)
		;
}

static int report(void)
{
	fid_out[fid_len] = 0;
	put_file("/tmp/fid-verdict", fid_len ? fid_out : "PASS\n");
	return 0;
}

static double now(clockid_t c)
{
	struct timespec t;
	clock_gettime(c, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static double secs(struct timespec t) { return t.tv_sec + t.tv_nsec / 1e9; }

/* Whole contents of a small text file (static buffer), or "" if it cannot be read. */
static const char *slurp(const char *path)
{
	static char buf[1 << 20];
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	size_t len = 0;
	ssize_t n;
	while (fd >= 0 && (n = read(fd, buf + len, sizeof buf - 1 - len)) > 0)  /* /proc: a page a read */
		len += n;
	if (fd >= 0)
		close(fd);
	buf[len] = 0;
	return buf;
}

static const char *fdlink(int fd)
{
	static char buf[512];
	char p[64];
	snprintf(p, sizeof p, "/proc/self/fd/%d", fd);
	ssize_t n = readlink(p, buf, sizeof buf - 1);
	buf[n > 0 ? n : 0] = 0;
	return buf;
}
