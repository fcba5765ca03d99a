/* fidelity: each thread's robust futex list (glibc's head, its length) */
#include "../each_thread.h"
#include <linux/futex.h>
#include <sys/syscall.h>

static void *heads[NT];
static size_t lens[NT];

static void get(void **head, size_t *len) { syscall(SYS_get_robust_list, 0, head, len); }

static void setup(int i) { get(&heads[i], &lens[i]); }

static void check(int i)
{
	void *head;
	size_t len;
	char what[64];
	get(&head, &len);
	snprintf(what, sizeof what, "thread %d robust list head", i);
	CHECK(head == heads[i], "%s: %p, want %p", what, head, heads[i]);
	snprintf(what, sizeof what, "thread %d robust list length", i);
	EQ(what, len, lens[i]);
}

int main(void)
{
	fid_init();
	each_thread_start();
	if (!heads[0] || heads[1] == heads[2]) {
		fprintf(stderr, "setup: glibc registered no robust lists\n");
		return 2;
	}
	ready();
	wait_term();
	each_thread_check();
	return report();
}
