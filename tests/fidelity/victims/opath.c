/* fidelity: O_PATH descriptors (a symlink itself with O_NOFOLLOW, a directory, a file) */
#include "../victim.h"

int main(void)
{
	fid_init();
	int f = open("/tmp/fid-target", O_WRONLY | O_CREAT, 0640);
	MUST(f);
	MUST(write(f, "target", 6));
	close(f);
	MUST(symlink("/tmp/fid-target", "/tmp/fid-link"));
	int l = open("/tmp/fid-link", O_PATH | O_NOFOLLOW);
	int d = open("/tmp", O_PATH | O_DIRECTORY | O_CLOEXEC);
	int p = open("/tmp/fid-link", O_PATH);  /* followed: the file */
	MUST(l | d | p);
	ready();
	wait_term();
	EQ("symlink fd flags", fcntl(l, F_GETFL) & (O_PATH | O_NOFOLLOW | O_ACCMODE), O_PATH | O_NOFOLLOW);
	struct stat st;
	MUST(fstatat(l, "", &st, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW));
	CHECK(S_ISLNK(st.st_mode), "the O_NOFOLLOW fd is not a symlink: mode %o", st.st_mode);
	char buf[64] = {0};
	readlinkat(l, "", buf, sizeof buf - 1);
	STREQ("symlink target", buf, "/tmp/fid-target");
	STREQ("symlink fd in /proc", fdlink(l), "/tmp/fid-link");
	EQ("directory fd flags", fcntl(d, F_GETFL) & (O_PATH | O_DIRECTORY), O_PATH | O_DIRECTORY);
	EQ("directory fd FD_CLOEXEC", fcntl(d, F_GETFD), FD_CLOEXEC);
	EQ("a file through the directory fd", fstatat(d, "fid-target", &st, 0), 0);
	MUST(fstatat(p, "", &st, AT_EMPTY_PATH));
	EQ("followed fd is the file", st.st_mode, S_IFREG | 0640);
	EQ("followed fd size", st.st_size, 6);
	CHECK(read(p, buf, 1) == -1 && errno == EBADF, "reading an O_PATH fd did not fail with EBADF");
	return report();
}
