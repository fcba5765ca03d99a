/* fidelity: a SysV semaphore set (id, key, mode, values, last operator) */
#include "../victim.h"
#include <sys/ipc.h>
#include <sys/sem.h>

union semun { int val; struct semid_ds *buf; unsigned short *array; };

int main(void)
{
	fid_init();
	int id = semget(0xf1de, 3, IPC_CREAT | IPC_EXCL | 0640);
	MUST(id);
	unsigned short vals[3] = {1, 5, 9};
	MUST(semctl(id, 0, SETALL, (union semun){.array = vals}));
	struct sembuf op = {.sem_num = 1, .sem_op = -2};
	MUST(semop(id, &op, 1));
	ready();
	wait_term();
	EQ("id by key", semget(0xf1de, 0, 0), id);
	unsigned short got[3] = {0};
	MUST(semctl(id, 0, GETALL, (union semun){.array = got}));
	EQ("sem 0", got[0], 1);
	EQ("sem 1", got[1], 3);
	EQ("sem 2", got[2], 9);
	EQ("last operator of sem 1", semctl(id, 1, GETPID), getpid());
	struct semid_ds ds;
	MUST(semctl(id, 0, IPC_STAT, (union semun){.buf = &ds}));
	EQ("nsems", ds.sem_nsems, 3);
	EQ("mode", ds.sem_perm.mode & 0777, 0640);
	EQ("key", ds.sem_perm.__key, 0xf1de);
	struct sembuf take = {.sem_num = 2, .sem_op = -9, .sem_flg = IPC_NOWAIT};
	EQ("semop still works", semop(id, &take, 1), 0);
	semctl(id, 0, IPC_RMID);
	return report();
}
