/* fidelity: a SysV semaphore operation with SEM_UNDO (undone when its process exits) */
#include "../victim.h"
#include <sys/ipc.h>
#include <sys/sem.h>

int main(void)
{
	fid_init();
	int id = semget(IPC_PRIVATE, 1, 0600);
	MUST(id);
	pid_t kid = fork();
	if (kid == 0) {
		struct sembuf up = {.sem_num = 0, .sem_op = 3, .sem_flg = SEM_UNDO};
		if (semop(id, &up, 1))
			_exit(2);
		pause();
	}
	while (semctl(id, 0, GETVAL) != 3)
		usleep(1000);
	ready();
	wait_term();
	EQ("value", semctl(id, 0, GETVAL), 3);
	kill(kid, SIGKILL);             /* its exit undoes its +3 (reaped or not: exit_sem comes first) */
	for (int i = 0; i < 200 && semctl(id, 0, GETVAL) == 3; i++)
		usleep(10000);
	EQ("value once the process that raised it with SEM_UNDO is gone", semctl(id, 0, GETVAL), 0);
	semctl(id, 0, IPC_RMID);
	return report();
}
