/* fidelity: memory two processes share (MAP_SHARED anonymous, SysV shm): writes seen by both */
#include "../victim.h"
#include <sys/ipc.h>
#include <sys/mman.h>
#include <sys/shm.h>

int main(void)
{
	fid_init();
	char *anon = mmap(0, 8192, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	MUST(anon == MAP_FAILED ? -1 : 0);
	int id = shmget(0xf1e0, 8192, IPC_CREAT | IPC_EXCL | 0640);
	MUST(id);
	char *shm = shmat(id, 0, 0);
	MUST(shm == (void *)-1 ? -1 : 0);
	strcpy(anon, "anon before");
	strcpy(shm, "shm before");
	int p[2];
	MUST(pipe(p));
	pid_t kid = fork();
	if (kid == 0) {                 /* copies what the other writes, once asked */
		char c;
		read(p[0], &c, 1);
		strcpy(anon + 4096, anon);
		strcpy(shm + 4096, shm);
		pause();
	}
	ready();
	wait_term();
	STREQ("anonymous shared page", anon, "anon before");
	STREQ("shm page", shm, "shm before");
	strcpy(anon, "anon after");
	strcpy(shm, "shm after");
	MUST(write(p[1], "?", 1));
	for (int i = 0; i < 200 && !shm[4096]; i++)
		usleep(10000);
	STREQ("the other process saw the anonymous write", anon + 4096, "anon after");
	STREQ("the other process saw the shm write", shm + 4096, "shm after");
	struct shmid_ds ds;
	MUST(shmctl(id, IPC_STAT, &ds));
	EQ("shm attaches", ds.shm_nattch, 2);
	EQ("shm mode", ds.shm_perm.mode & 0777, 0640);
	EQ("shm id by key", shmget(0xf1e0, 0, 0), id);
	kill(kid, SIGKILL);
	shmctl(id, IPC_RMID, 0);
	return report();
}
