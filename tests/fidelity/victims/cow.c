/* fidelity: private pages two processes share copy-on-write (same physical pages in both) */
#include "../victim.h"
#include <stdint.h>
#include <sys/mman.h>

#define PAGES 64

static void frames(uint64_t *out, char *mem)
{
	int fd = open("/proc/self/pagemap", O_RDONLY);
	for (int i = 0; i < PAGES; i++) {
		uint64_t e = 0;
		pread(fd, &e, 8, ((uintptr_t)(mem + i * 4096) / 4096) * 8);
		out[i] = e & ((1ULL << 55) - 1);   /* the frame number (bits 0-54) */
	}
	close(fd);
}

int main(void)
{
	fid_init();
	char *mem = mmap(0, PAGES * 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	MUST(mem == MAP_FAILED ? -1 : 0);
	for (int i = 0; i < PAGES; i++)
		mem[i * 4096] = (char)i;
	int p[2], q[2];
	MUST(pipe(p) | pipe(q));
	pid_t kid = fork();
	if (kid == 0) {
		char c;
		uint64_t f[PAGES];
		read(p[0], &c, 1);
		frames(f, mem);
		write(q[1], f, sizeof f);
		pause();
	}
	uint64_t mine[PAGES], theirs[PAGES];
	frames(mine, mem);
	/* pagemap shows frame numbers only to CAP_SYS_ADMIN of the host's user namespace: in a
	 * sandbox the harness compares them from the host, at the range and pids named here
	 * (test_fidelity.HOST_CHECKS) */
	int visible = mine[0] != 0;
	char at[64];
	snprintf(at, sizeof at, "%lx %d\n", (unsigned long)mem, (int)kid);
	put_file("/tmp/fid-cow", at);
	ready();
	wait_term();
	if (visible) {
		MUST(write(p[1], "?", 1));
		EQ("frames read", read(q[0], theirs, sizeof theirs), sizeof theirs);
		frames(mine, mem);
		int shared = 0;
		for (int i = 0; i < PAGES; i++)
			shared += mine[i] && mine[i] == theirs[i];
		EQ("pages still shared with the child process", shared, PAGES);
	}
	for (int i = 0; i < PAGES; i++)
		CHECK(mem[i * 4096] == (char)i, "page %d contents", i);
	kill(kid, SIGKILL);
	return report();
}
