/* fidelity: each thread's robust futex list (glibc's head, its length) */
#include "../victim.h"
#include <linux/futex.h>
#include <sys/syscall.h>

#define NT 3
static pthread_barrier_t b;
static void *heads[NT];
static size_t lens[NT];

static void get(void **head, size_t *len) { syscall(SYS_get_robust_list, 0, head, len); }

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

static void *thread(void *a)
{
	int i = (int)(long)a;
	get(&heads[i], &lens[i]);
	pthread_barrier_wait(&b);
	pthread_barrier_wait(&b);
	check(i);
	pthread_barrier_wait(&b);
	return 0;
}

int main(void)
{
	fid_init();
	pthread_barrier_init(&b, 0, NT);
	pthread_t t;
	for (long i = 1; i < NT; i++)
		pthread_create(&t, 0, thread, (void *)i);
	get(&heads[0], &lens[0]);
	pthread_barrier_wait(&b);
	if (!heads[0] || heads[1] == heads[2]) {
		fprintf(stderr, "setup: glibc registered no robust lists\n");
		return 2;
	}
	ready();
	wait_term();
	pthread_barrier_wait(&b);
	check(0);
	pthread_barrier_wait(&b);
	return report();
}
