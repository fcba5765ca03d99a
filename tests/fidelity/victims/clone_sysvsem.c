/* fidelity: two processes sharing one SysV semaphore undo list (CLONE_SYSVSEM) */
#define _GNU_SOURCE
#include "../victim.h"
#include <sched.h>
#include <sys/ipc.h>
#include <sys/sem.h>
#include <sys/wait.h>

static int p[2], semid;
static char stack[65536] __attribute__((aligned(16)));

/* On a byte, raises the semaphore with SEM_UNDO and exits: its undo entry is in the shared
 * list, so its exit undoes nothing while the other process lives. */
static int sharer(void *a)
{
	(void)a;
	char c;
	if (read(p[0], &c, 1) != 1)
		_exit(1);
	struct sembuf up = {0, 1, SEM_UNDO};
	_exit(semop(semid, &up, 1) ? 3 : 0);
}

int main(void)
{
	fid_init();
	MUST(pipe(p));
	MUST(semid = semget(IPC_PRIVATE, 1, IPC_CREAT | 0600));
	pid_t kid = clone(sharer, stack + sizeof stack, CLONE_SYSVSEM | SIGCHLD, 0);
	MUST(kid);
	ready();
	wait_term();
	write(p[1], "!", 1);
	int st = -1;
	EQ("the other process ends", waitpid(kid, &st, 0), kid);
	EQ("its semop", WIFEXITED(st) ? WEXITSTATUS(st) : -1, 0);
	EQ("its SEM_UNDO is kept in the list it shares with this one", semctl(semid, 0, GETVAL), 1);
	semctl(semid, 0, IPC_RMID);
	return report();
}
