/* fidelity: unix sockets bound to paths (the socket file's owner and mode; a name whose file was removed stays without one) */
#include "../victim.h"
#include <sys/socket.h>
#include <sys/un.h>

static int bound(const char *path, int listening)
{
	struct sockaddr_un a = {.sun_family = AF_UNIX};
	strcpy(a.sun_path, path);
	int s = socket(AF_UNIX, SOCK_STREAM, 0);
	MUST(s);
	MUST(bind(s, (struct sockaddr *)&a, sizeof a));
	if (listening)
		MUST(listen(s, 4));
	return s;
}

int main(void)
{
	fid_init();
	int owned = bound("/tmp/fid-owned.sock", 1);
	MUST(chown("/tmp/fid-owned.sock", 1234, 5678));
	MUST(chmod("/tmp/fid-owned.sock", 0640));
	int gone = bound("/tmp/fid-gone.sock", 1);
	MUST(unlink("/tmp/fid-gone.sock"));
	ready();
	wait_term();
	struct stat st;
	MUST(stat("/tmp/fid-owned.sock", &st));
	CHECK(S_ISSOCK(st.st_mode), "the socket file is not a socket");
	EQ("socket file's uid", st.st_uid, 1234);
	EQ("socket file's gid", st.st_gid, 5678);
	EQ("socket file's mode", st.st_mode & 07777, 0640);
	struct sockaddr_un a = {.sun_family = AF_UNIX};
	strcpy(a.sun_path, "/tmp/fid-owned.sock");
	int c = socket(AF_UNIX, SOCK_STREAM, 0);
	CHECK(connect(c, (struct sockaddr *)&a, sizeof a) == 0, "connect to the listener: %s", strerror(errno));
	CHECK(stat("/tmp/fid-gone.sock", &st) == -1 && errno == ENOENT, "the removed socket file is there again");
	socklen_t len = sizeof a;
	MUST(getsockname(gone, (struct sockaddr *)&a, &len));
	STREQ("the removed file's socket's name", a.sun_path, "/tmp/fid-gone.sock");
	close(owned);
	return report();
}
