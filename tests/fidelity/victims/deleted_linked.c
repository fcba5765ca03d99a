/* fidelity: a file held open by a name since removed while another name of it stays (writes seen through that name) */
#include "../victim.h"

int main(void)
{
	fid_init();
	int fd = open("/tmp/fid-first", O_RDWR | O_CREAT | O_TRUNC, 0640);
	MUST(fd);
	MUST(write(fd, "one\n", 4));
	MUST(link("/tmp/fid-first", "/tmp/fid-second"));
	MUST(unlink("/tmp/fid-first"));
	ready();
	wait_term();
	struct stat st, named;
	MUST(fstat(fd, &st));
	MUST(stat("/tmp/fid-second", &named));
	EQ("links", st.st_nlink, 1);
	EQ("the other name's inode", named.st_ino, st.st_ino);
	EQ("offset", lseek(fd, 0, SEEK_CUR), 4);
	STREQ("name in /proc", fdlink(fd), "/tmp/fid-first (deleted)");
	CHECK(write(fd, "two\n", 4) == 4, "write: %s", strerror(errno));
	STREQ("seen through the other name", slurp("/tmp/fid-second"), "one\ntwo\n");
	return report();
}
