/* fidelity: per-process attributes (rlimits, umask, nice, cwd, environment, personality, prctl) */
#include "../victim.h"
#include <sys/personality.h>
#include <sys/prctl.h>
#include <sys/resource.h>

int main(void)
{
	fid_init();
	struct rlimit nofile = {512, 1024}, core = {0, 4096}, stack = {12 << 20, RLIM_INFINITY};
	MUST(setrlimit(RLIMIT_NOFILE, &nofile) | setrlimit(RLIMIT_CORE, &core) | setrlimit(RLIMIT_STACK, &stack));
	umask(027);
	MUST(setpriority(PRIO_PROCESS, 0, 7));
	MUST(mkdir("/tmp/fid-here", 0755));
	MUST(chdir("/tmp/fid-here"));
	MUST(setenv("FID_VAR", "set at run time", 1));
	MUST(personality(PER_LINUX | ADDR_NO_RANDOMIZE));
	MUST(prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) | prctl(PR_SET_CHILD_SUBREAPER, 1) | prctl(PR_SET_DUMPABLE, 0));
	MUST(prctl(PR_SET_TIMERSLACK, 123456) | prctl(PR_SET_NAME, "fid-attrs"));
	ready();
	wait_term();
	struct rlimit r;
	getrlimit(RLIMIT_NOFILE, &r);
	EQ("RLIMIT_NOFILE soft", r.rlim_cur, 512);
	EQ("RLIMIT_NOFILE hard", r.rlim_max, 1024);
	getrlimit(RLIMIT_CORE, &r);
	EQ("RLIMIT_CORE hard", r.rlim_max, 4096);
	getrlimit(RLIMIT_STACK, &r);
	EQ("RLIMIT_STACK soft", r.rlim_cur, 12 << 20);
	EQ("umask", umask(027), 027);
	errno = 0;
	EQ("nice", getpriority(PRIO_PROCESS, 0), 7);
	char cwd[256] = {0};
	STREQ("cwd", getcwd(cwd, sizeof cwd), "/tmp/fid-here");
	STREQ("environment", getenv("FID_VAR"), "set at run time");
	EQ("personality", personality(0xffffffff), PER_LINUX | ADDR_NO_RANDOMIZE);
	EQ("no_new_privs", prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0), 1);
	int sub = 0;
	prctl(PR_GET_CHILD_SUBREAPER, &sub);
	EQ("child subreaper", sub, 1);
	EQ("dumpable", prctl(PR_GET_DUMPABLE), 0);
	EQ("timer slack (ns)", prctl(PR_GET_TIMERSLACK), 123456);
	char name[16] = {0};
	prctl(PR_GET_NAME, name);
	STREQ("name", name, "fid-attrs");
	return report();
}
