/* fidelity: a deleted current directory and a deleted directory held open */
#include "../victim.h"

int main(void)
{
	fid_init();
	umask(0);
	MUST(mkdir("/tmp/fid-cwd", 0751));
	MUST(mkdir("/tmp/fid-dir", 0705));
	MUST(chown("/tmp/fid-dir", 77, 88));
	MUST(chdir("/tmp/fid-cwd"));
	int d = open("/tmp/fid-dir", O_RDONLY | O_DIRECTORY);
	MUST(d);
	MUST(rmdir("/tmp/fid-cwd"));
	MUST(rmdir("/tmp/fid-dir"));
	ready();
	wait_term();
	struct stat st;
	MUST(stat(".", &st));
	EQ("cwd mode", st.st_mode, S_IFDIR | 0751);
	EQ("cwd links (deleted)", st.st_nlink, 0);
	char buf[256] = {0};
	readlink("/proc/self/cwd", buf, sizeof buf - 1);
	STREQ("cwd in /proc", buf, "/tmp/fid-cwd (deleted)");
	CHECK(open("new", O_CREAT | O_WRONLY, 0600) == -1 && errno == ENOENT, "creating in a deleted cwd did not fail with ENOENT");
	MUST(fstat(d, &st));
	EQ("directory mode", st.st_mode, S_IFDIR | 0705);
	EQ("directory uid", st.st_uid, 77);
	EQ("directory gid", st.st_gid, 88);
	EQ("directory links (deleted)", st.st_nlink, 0);
	STREQ("directory in /proc", fdlink(d), "/tmp/fid-dir (deleted)");
	EQ("directory flags", fcntl(d, F_GETFL) & (O_ACCMODE | O_DIRECTORY), O_RDONLY | O_DIRECTORY);
	return report();
}
