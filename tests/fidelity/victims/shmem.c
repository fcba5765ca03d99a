/* fidelity: a /dev/shm file (open flags, offset, mode) and a shared mapping of it */
#include "../victim.h"
#include <sys/mman.h>

int main(void)
{
	fid_init();
	umask(0);
	int fd = open("/dev/shm/fid-shm", O_RDWR | O_CREAT | O_APPEND | O_NONBLOCK, 0660);
	MUST(fd);
	MUST(ftruncate(fd, 4096));
	char *m = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	MUST(m == MAP_FAILED ? -1 : 0);
	strcpy(m, "shared page");
	int ro = open("/dev/shm/fid-shm", O_RDONLY | O_NOATIME);
	MUST(ro);
	MUST(lseek(ro, 7, SEEK_SET));
	ready();
	wait_term();
	EQ("flags", fcntl(fd, F_GETFL) & (O_ACCMODE | O_APPEND | O_NONBLOCK), O_RDWR | O_APPEND | O_NONBLOCK);
	EQ("read-only flags", fcntl(ro, F_GETFL) & (O_ACCMODE | O_NOATIME), O_RDONLY | O_NOATIME);
	EQ("offset", lseek(ro, 0, SEEK_CUR), 7);
	struct stat st;
	MUST(fstat(fd, &st));
	EQ("mode", st.st_mode, S_IFREG | 0660);
	EQ("size", st.st_size, 4096);
	char buf[8] = {0};
	EQ("read", read(ro, buf, 4), 4);
	STREQ("contents at the offset", buf, "page");
	strcpy(m, "SHARED");
	EQ("pread", pread(ro, buf, 6, 0), 6);
	STREQ("mapping shared with the file", buf, "SHARED");
	return report();
}
