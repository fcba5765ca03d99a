/* A process in vfork(): "vforker MS" vforks from its main thread, "vforker MS thread" from a
 * second thread while the main thread runs on. It writes /tmp/vforking (the vforking thread's
 * tid) before the vfork; the child waits MS ms, then execs a shell that writes its pid to
 * /tmp/execd and becomes `sleep 1000`; the parent, resumed, writes the child's pid to
 * /tmp/resumed. Each file appears whole (written aside, then renamed). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static long ms;

static void put(const char *path, long value)
{
	char part[64];
	snprintf(part, sizeof(part), "%s.part", path);
	FILE *f = fopen(part, "w");
	fprintf(f, "%ld\n", value);
	fclose(f);
	rename(part, path);
}

static void *vforker(void *arg)
{
	put("/tmp/vforking", (long)syscall(SYS_gettid));
	pid_t p = vfork();
	if (p == 0) {
		struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
		nanosleep(&ts, 0);
		execl("/bin/sh", "sh", "-c", "echo $$ > /tmp/execd; exec sleep 1000", (char *)0);
		_exit(127);
	}
	put("/tmp/resumed", p);
	for (;;)
		pause();
	return arg;
}

int main(int argc, char **argv)
{
	ms = atol(argv[1]);
	if (argc > 2 && !strcmp(argv[2], "thread")) {
		pthread_t t;
		pthread_create(&t, 0, vforker, 0);
		for (;;)
			pause();
	}
	vforker(0);
}
