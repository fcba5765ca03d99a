/* fidelity: pipes with bytes queued (a resized one nearly full), their flags and sizes */
#include "../victim.h"
#include <sys/ioctl.h>

#define BIG 200000

int main(void)
{
	fid_init();
	int a[2], b[2];
	MUST(pipe2(a, O_CLOEXEC) | pipe(b));
	MUST(fcntl(a[0], F_SETPIPE_SZ, 256 * 1024));
	static unsigned char data[BIG];
	for (int i = 0; i < BIG; i++)
		data[i] = (unsigned char)(i * 7 + i / 251);
	MUST(write(a[1], data, BIG));
	MUST(fcntl(b[1], F_SETFL, O_NONBLOCK));
	MUST(write(b[1], "small", 5));
	close(b[0]);                   /* b: a writer with no reader left */
	signal(SIGPIPE, SIG_IGN);
	ready();
	wait_term();
	EQ("pipe size", fcntl(a[0], F_GETPIPE_SZ), 256 * 1024);
	int queued = -1;
	ioctl(a[0], FIONREAD, &queued);
	EQ("queued bytes", queued, BIG);
	EQ("FD_CLOEXEC", fcntl(a[1], F_GETFD), FD_CLOEXEC);
	static unsigned char got[BIG];
	size_t n = 0;
	ssize_t r;
	fcntl(a[0], F_SETFL, O_NONBLOCK);
	while (n < BIG && (r = read(a[0], got + n, BIG - n)) > 0)
		n += r;
	EQ("bytes read", n, BIG);
	EQ("bytes as written", memcmp(got, data, BIG), 0);
	EQ("O_NONBLOCK writer", fcntl(b[1], F_GETFL) & (O_ACCMODE | O_NONBLOCK), O_WRONLY | O_NONBLOCK);
	CHECK(write(b[1], "x", 1) == -1 && errno == EPIPE, "write with no reader did not fail with EPIPE");
	return report();
}
