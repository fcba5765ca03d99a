/* Locks its memory: a range with mlock2(MLOCK_ONFAULT), then mlockall(MCL_FUTURE) with
 * MCL_ONFAULT (argv[1] "onfault") or with MCL_CURRENT (every mapping locked and populated).
 * On each SIGUSR1 it maps a new page and writes to /tmp/seen the lock flags ("lo", "lf") of
 * that page's and of the range's VmFlags, as JSON. A C program, so that MCL_CURRENT locks a
 * few MiB, within the RLIMIT_MEMLOCK root of a sandbox's user namespace is held to (only the
 * host's root is exempt), where python3 maps tens of MiB. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef MLOCK_ONFAULT
#define MLOCK_ONFAULT 1
#endif

/* The "lo"/"lf" flags of the mapping starting at addr, as a JSON list, into out. */
static void lock_flags(void *addr, char *out, size_t size)
{
	char head[32], line[1024];
	snprintf(head, sizeof head, "%lx-", (unsigned long)addr);
	FILE *f = fopen("/proc/self/smaps", "r");
	int found = 0;
	snprintf(out, size, "[]");
	while (f && fgets(line, sizeof line, f)) {
		if (!found) {
			found = !strncmp(line, head, strlen(head));
			continue;
		}
		if (strncmp(line, "VmFlags:", 8))
			continue;
		size_t n = snprintf(out, size, "[");
		for (char *t = strtok(line + 8, " \n"); t; t = strtok(NULL, " \n"))
			if (!strcmp(t, "lo") || !strcmp(t, "lf"))
				n += snprintf(out + n, size - n, "%s\"%s\"", n > 1 ? ", " : "", t);
		snprintf(out + n, size - n, "]");
		break;
	}
	if (f)
		fclose(f);
}

static void put(const char *path, const char *text)
{
	char tmp[64];
	snprintf(tmp, sizeof tmp, "%s.tmp", path);
	FILE *f = fopen(tmp, "w");
	if (!f || fputs(text, f) < 0 || fclose(f) || rename(tmp, path))
		exit(4);
}

int main(int argc, char **argv)
{
	int onfault = argc > 1 && !strcmp(argv[1], "onfault");
	char *range = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (range == MAP_FAILED || syscall(SYS_mlock2, range, 8192, MLOCK_ONFAULT)) {
		perror("mlock2");
		return 2;
	}
	if (mlockall(MCL_FUTURE | (onfault ? MCL_ONFAULT : MCL_CURRENT))) {
		perror("mlockall");
		return 3;
	}
	sigset_t usr1;
	sigemptyset(&usr1);
	sigaddset(&usr1, SIGUSR1);
	sigprocmask(SIG_BLOCK, &usr1, NULL);
	put("/tmp/ready", "");
	for (;;) {
		int sig;
		sigwait(&usr1, &sig);
		void *fresh = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
		char a[64], b[64], text[160];
		lock_flags(fresh, a, sizeof a);
		lock_flags(range, b, sizeof b);
		snprintf(text, sizeof text, "{\"new\": %s, \"range\": %s}", a, b);
		put("/tmp/seen", text);
	}
}
