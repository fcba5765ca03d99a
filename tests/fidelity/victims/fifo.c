/* fidelity: FIFOs read-write with bytes, write-only with no reader, unlinked */
#include "../victim.h"

int main(void)
{
	fid_init();
	signal(SIGPIPE, SIG_IGN);
	MUST(mkfifo("/tmp/fid-rw", 0640) | mkfifo("/tmp/fid-wo", 0600) | mkfifo("/tmp/fid-unl", 0666));
	int rw = open("/tmp/fid-rw", O_RDWR);
	MUST(rw);
	MUST(write(rw, "rdwr", 4));
	int r = open("/tmp/fid-wo", O_RDONLY | O_NONBLOCK), wo = open("/tmp/fid-wo", O_WRONLY);
	MUST(r | wo);
	MUST(write(wo, "wronly", 6));
	close(r);                      /* bytes stay in the pipe while a writer holds it */
	int u = open("/tmp/fid-unl", O_RDWR | O_NONBLOCK);
	MUST(u);
	MUST(write(u, "unlinked", 8));
	MUST(unlink("/tmp/fid-unl"));
	ready();
	wait_term();
	char buf[16] = {0};
	fcntl(rw, F_SETFL, O_NONBLOCK);
	EQ("read-write fifo bytes", read(rw, buf, sizeof buf), 4);
	STREQ("read-write fifo", buf, "rdwr");
	EQ("write-only flags", fcntl(wo, F_GETFL) & O_ACCMODE, O_WRONLY);
	CHECK(write(wo, "x", 1) == -1 && errno == EPIPE, "write with no reader did not fail with EPIPE");
	int again = open("/tmp/fid-wo", O_RDONLY | O_NONBLOCK);
	memset(buf, 0, sizeof buf);
	EQ("bytes a new reader finds", read(again, buf, sizeof buf), 6);
	STREQ("write-only fifo", buf, "wronly");
	memset(buf, 0, sizeof buf);
	EQ("unlinked fifo flags", fcntl(u, F_GETFL) & (O_ACCMODE | O_NONBLOCK), O_RDWR | O_NONBLOCK);
	EQ("unlinked fifo bytes", read(u, buf, sizeof buf), 8);
	STREQ("unlinked fifo", buf, "unlinked");
	struct stat st;
	MUST(fstat(u, &st));
	EQ("unlinked fifo links", st.st_nlink, 0);
	EQ("unlinked fifo mode", st.st_mode, S_IFIFO | 0644);
	MUST(stat("/tmp/fid-rw", &st));
	EQ("named fifo mode", st.st_mode, S_IFIFO | 0640);
	return report();
}
