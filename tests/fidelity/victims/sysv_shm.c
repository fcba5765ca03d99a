/* fidelity: SysV shared memory (owner, SHM_LOCK, a segment removed while attached, an attachment split by mprotect) */
#include "../victim.h"
#include <sys/ipc.h>
#include <sys/mman.h>
#include <sys/shm.h>

/* the permissions /proc/self/maps shows at ``addr`` ("rw-s"), "" if nothing is mapped there */
static const char *perms_at(char *addr)
{
	static char perms[8];
	char line[512];
	FILE *f = fopen("/proc/self/maps", "r");
	perms[0] = 0;
	while (f && fgets(line, sizeof line, f)) {
		unsigned long lo, hi;
		char p[8];
		if (sscanf(line, "%lx-%lx %7s", &lo, &hi, p) == 3 && (unsigned long)addr >= lo && (unsigned long)addr < hi)
			strcpy(perms, p);
	}
	if (f)
		fclose(f);
	return perms;
}

int main(void)
{
	fid_init();
	long page = sysconf(_SC_PAGESIZE);
	int owned = shmget(0xf1e1, page, IPC_CREAT | IPC_EXCL | 0600);
	MUST(owned);
	struct shmid_ds ds;
	MUST(shmctl(owned, IPC_STAT, &ds));
	ds.shm_perm.uid = 1234;
	ds.shm_perm.gid = 5678;
	ds.shm_perm.mode = 0644;
	MUST(shmctl(owned, IPC_SET, &ds));
	MUST(shmctl(owned, SHM_LOCK, 0));
	int gone = shmget(0xf1e2, page, IPC_CREAT | IPC_EXCL | 0600);
	MUST(gone);
	char *g = shmat(gone, 0, 0);
	MUST(g == (void *)-1 ? -1 : 0);
	strcpy(g, "removed but attached");
	MUST(shmctl(gone, IPC_RMID, 0));
	int split = shmget(0xf1e3, 3 * page, IPC_CREAT | IPC_EXCL | 0600);
	MUST(split);
	char *s = shmat(split, 0, 0);
	MUST(s == (void *)-1 ? -1 : 0);
	strcpy(s + 2 * page, "third page");
	MUST(mprotect(s + page, page, PROT_READ));
	ready();
	wait_term();
	MUST(shmctl(owned, IPC_STAT, &ds));
	EQ("owner uid", ds.shm_perm.uid, 1234);
	EQ("owner gid", ds.shm_perm.gid, 5678);
	EQ("mode", ds.shm_perm.mode & 0777, 0644);
	CHECK(ds.shm_perm.mode & SHM_LOCKED, "the segment is not locked (SHM_LOCK)");
	CHECK(shmctl(gone, IPC_STAT, &ds) == 0, "the removed segment: IPC_STAT: %s", strerror(errno));
	CHECK(ds.shm_perm.mode & SHM_DEST, "the removed segment is not marked removed (SHM_DEST)");
	EQ("the removed segment's attaches", ds.shm_nattch, 1);
	EQ("the removed segment by its key", shmget(0xf1e2, 0, 0), -1);
	STREQ("the removed segment's bytes", g, "removed but attached");
	MUST(shmdt(g));
	CHECK(shmctl(gone, IPC_STAT, &ds) == -1, "the removed segment outlived its last detach");
	STREQ("first page", perms_at(s), "rw-s");
	STREQ("mprotected page", perms_at(s + page), "r--s");
	STREQ("third page", perms_at(s + 2 * page), "rw-s");
	STREQ("past the attachment", perms_at(s + 3 * page), "");
	STREQ("bytes of the third page", s + 2 * page, "third page");
	MUST(shmctl(split, IPC_STAT, &ds));
	EQ("split segment's attaches (one a piece: the kernel counts areas)", ds.shm_nattch, 3);
	shmctl(owned, IPC_RMID, 0);
	shmctl(split, IPC_RMID, 0);
	return report();
}
