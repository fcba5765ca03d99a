/* fidelity: madvise and mlock flags of mappings (VmFlags in /proc/self/smaps) and protections */
#include "../victim.h"
#include <sys/mman.h>

static const struct { int advice; const char *flag; } advice[] = {
	{MADV_RANDOM, "rr"}, {MADV_SEQUENTIAL, "sr"}, {MADV_DONTDUMP, "dd"},
	{MADV_HUGEPAGE, "hg"}, {MADV_NOHUGEPAGE, "nh"}, {MADV_MERGEABLE, "mg"},
};
#define N (sizeof advice / sizeof *advice)
#define LEN (4 << 20)

static const char *vmflags(void *addr)
{
	static char line[256];
	char head[32];
	snprintf(head, sizeof head, "%lx-", (unsigned long)addr);
	const char *s = slurp("/proc/self/smaps");
	const char *at = strstr(s, head), *f = at ? strstr(at, "VmFlags:") : 0;
	if (!f)
		return "(no mapping)";
	size_t n = strcspn(f, "\n");
	snprintf(line, sizeof line, "%.*s ", (int)n, f);
	return line;
}

static int has(const char *flags, const char *f)
{
	char w[8];
	snprintf(w, sizeof w, " %s ", f);
	return strstr(flags, w) != 0;
}

int main(void)
{
	fid_init();
	char *m[N + 1];
	for (size_t i = 0; i <= N; i++) {
		m[i] = mmap(0, LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		MUST(m[i] == MAP_FAILED ? -1 : 0);
		memset(m[i], (int)i + 1, 4096);
		if (i < N)
			MUST(madvise(m[i], LEN, advice[i].advice));
	}
	MUST(mlock(m[N], 8192));                /* its first two pages: a mapping of its own, "lo" */
	MUST(mprotect(m[N] + LEN / 2, LEN / 2, PROT_READ));
	ready();
	wait_term();
	for (size_t i = 0; i < N; i++) {
		const char *f = vmflags(m[i]);
		CHECK(has(f, advice[i].flag), "mapping %zu madvised '%s': %s", i, advice[i].flag, f);
		EQ("first byte", m[i][0], (char)(i + 1));
	}
	const char *lo = vmflags(m[N]);
	CHECK(has(lo, "lo"), "mlocked pages not locked: %s", lo);
	const char *ro = vmflags(m[N] + LEN / 2);
	CHECK(has(ro, "rd") && !has(ro, "wr"), "mprotected read-only half: %s", ro);
	return report();
}
