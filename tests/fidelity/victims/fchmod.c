/* fidelity: a file whose mode and owner were changed through its descriptor (fchmod, fchown) */
#include "../victim.h"

int main(void)
{
	fid_init();
	int fd = open("/tmp/fid-file", O_RDWR | O_CREAT | O_TRUNC, 0644);
	MUST(fd);
	MUST(write(fd, "0123456789", 10));
	MUST(fchmod(fd, 04711));
	MUST(fchown(fd, 1001, 1002));
	MUST(fchmod(fd, 0604));     /* after fchown: chown clears set-uid bits, set them knowingly */
	MUST(lseek(fd, 3, SEEK_SET));
	int dfd = open("/tmp", O_RDONLY | O_DIRECTORY);
	MUST(dfd);
	ready();
	wait_term();
	struct stat st, byname;
	MUST(fstat(fd, &st));
	EQ("mode", st.st_mode, S_IFREG | 0604);
	EQ("uid", st.st_uid, 1001);
	EQ("gid", st.st_gid, 1002);
	EQ("offset", lseek(fd, 0, SEEK_CUR), 3);
	MUST(stat("/tmp/fid-file", &byname));
	EQ("same file as its path (inode)", st.st_ino, byname.st_ino);
	EQ("mode by path", byname.st_mode, S_IFREG | 0604);
	EQ("directory fd is /tmp", fstatat(dfd, "fid-file", &byname, 0), 0);
	EQ("fd flags", fcntl(fd, F_GETFL) & O_ACCMODE, O_RDWR);
	char c;
	EQ("read", read(fd, &c, 1), 1);
	EQ("byte at 3", c, '3');
	return report();
}
