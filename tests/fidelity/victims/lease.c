/* fidelity: a file lease (F_SETLEASE) */
#include "../victim.h"

int main(void)
{
	fid_init();
	int fd = open("/tmp/fid-leased", O_RDONLY | O_CREAT, 0644);
	MUST(fd);
	MUST(fcntl(fd, F_SETLEASE, F_RDLCK));
	ready();
	wait_term();
	EQ("lease", fcntl(fd, F_GETLEASE), F_RDLCK);
	return report();
}
