/* fidelity: a deleted file held open (contents, offset, flags, mode, owner, its name in /proc) */
#include "../victim.h"

int main(void)
{
	fid_init();
	umask(0);
	int fd = open("/tmp/fid-gone", O_RDWR | O_CREAT | O_APPEND, 0640);
	MUST(fd);
	MUST(write(fd, "deleted but open\n", 17));
	MUST(fchown(fd, 1234, 5678));
	int ro = open("/tmp/fid-gone", O_RDONLY | O_CLOEXEC);
	MUST(ro);
	MUST(lseek(ro, 8, SEEK_SET));
	MUST(unlink("/tmp/fid-gone"));
	ready();
	wait_term();
	struct stat st;
	MUST(fstat(fd, &st));
	EQ("mode", st.st_mode, S_IFREG | 0640);
	EQ("uid", st.st_uid, 1234);
	EQ("gid", st.st_gid, 5678);
	EQ("links", st.st_nlink, 0);
	EQ("size", st.st_size, 17);
	EQ("O_APPEND fd flags", fcntl(fd, F_GETFL) & (O_ACCMODE | O_APPEND), O_RDWR | O_APPEND);
	EQ("read-only fd flags", fcntl(ro, F_GETFL) & O_ACCMODE, O_RDONLY);
	EQ("read-only fd FD_CLOEXEC", fcntl(ro, F_GETFD), FD_CLOEXEC);
	EQ("read-only fd offset", lseek(ro, 0, SEEK_CUR), 8);
	STREQ("name in /proc", fdlink(fd), "/tmp/fid-gone (deleted)");
	char buf[32] = {0};
	EQ("read at offset", read(ro, buf, sizeof buf), 9);
	STREQ("bytes", buf, "but open\n");
	CHECK(write(fd, "more\n", 5) == 5, "write: %s", strerror(errno));
	EQ("size after an append", lseek(ro, 0, SEEK_END), 22);
	return report();
}
