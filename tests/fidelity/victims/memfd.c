/* fidelity: memfds (contents, size, seals, open flags, mode, a shared mapping of one) */
#include "../victim.h"
#include <sys/mman.h>

int main(void)
{
	fid_init();
	int a = memfd_create("fid-sealed", MFD_ALLOW_SEALING | MFD_CLOEXEC);
	MUST(a);
	MUST(write(a, "sealed bytes", 12));
	MUST(fchmod(a, 0640));
	MUST(fcntl(a, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW));
	MUST(lseek(a, 7, SEEK_SET));
	int b = memfd_create("fid-plain", 0);
	MUST(b);
	MUST(ftruncate(b, 8192));
	char *m = mmap(0, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, b, 0);
	MUST(m == MAP_FAILED ? -1 : 0);
	strcpy(m + 4096, "mapped");
	char p[64];
	snprintf(p, sizeof p, "/proc/self/fd/%d", b);
	int c = open(p, O_RDONLY | O_NONBLOCK);
	MUST(c);
	ready();
	wait_term();
	EQ("seals", fcntl(a, F_GET_SEALS), F_SEAL_SHRINK | F_SEAL_GROW);
	EQ("unsealed memfd's seals", fcntl(b, F_GET_SEALS), F_SEAL_SEAL);
	EQ("FD_CLOEXEC", fcntl(a, F_GETFD), FD_CLOEXEC);
	EQ("plain FD_CLOEXEC", fcntl(b, F_GETFD), 0);
	EQ("flags", fcntl(a, F_GETFL) & O_ACCMODE, O_RDWR);
	EQ("reopened flags", fcntl(c, F_GETFL) & (O_ACCMODE | O_NONBLOCK), O_RDONLY | O_NONBLOCK);
	EQ("offset", lseek(a, 0, SEEK_CUR), 7);
	struct stat st;
	MUST(fstat(a, &st));
	EQ("mode", st.st_mode & 07777, 0640);
	EQ("size", st.st_size, 12);
	STREQ("name", fdlink(a), "/memfd:fid-sealed (deleted)");
	CHECK(ftruncate(a, 4) == -1 && errno == EPERM, "shrinking a sealed memfd did not fail with EPERM");
	char buf[16] = {0};
	EQ("read", pread(a, buf, 12, 0), 12);
	STREQ("contents", buf, "sealed bytes");
	memset(buf, 0, sizeof buf);
	EQ("read the mapped page", pread(c, buf, 6, 4096), 6);
	STREQ("mapping seen through the file", buf, "mapped");
	strcpy(m + 4096, "MAPPED");
	EQ("read again", pread(c, buf, 6, 4096), 6);
	STREQ("mapping still shared with the file", buf, "MAPPED");
	return report();
}
