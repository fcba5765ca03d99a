/* fidelity: a shared mapping of a deleted file whose name was taken again (the mapping is still of the deleted file) */
#include "../victim.h"
#include <sys/mman.h>

int main(void)
{
	fid_init();
	int fd = open("/tmp/fid-mapped", O_RDWR | O_CREAT | O_TRUNC, 0640);
	MUST(fd);
	MUST(ftruncate(fd, 8192));
	char *m = mmap(0, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	MUST(m == MAP_FAILED ? -1 : 0);
	strcpy(m + 4096, "old file");
	MUST(unlink("/tmp/fid-mapped"));
	put_file("/tmp/fid-mapped", "new file");  /* rotated, as a log is */
	ready();
	wait_term();
	STREQ("mapped bytes", m + 4096, "old file");
	strcpy(m + 4096, "OLD FILE");
	char buf[16] = {0};
	EQ("read through the descriptor", pread(fd, buf, 8, 4096), 8);
	STREQ("the mapping is the descriptor's file", buf, "OLD FILE");
	STREQ("the new file", slurp("/tmp/fid-mapped"), "new file");
	return report();
}
