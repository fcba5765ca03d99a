/* fidelity: parent links (getppid, wait() for children, a zombie, process groups, PDEATHSIG) */
#include "../victim.h"
#include <sys/prctl.h>
#include <sys/wait.h>

int main(void)
{
	fid_init();
	int p[2], q[2];
	MUST(pipe(p) | pipe(q));
	pid_t me = getpid(), sleeper = fork();
	if (sleeper == 0) {            /* in a process group of its own, dies with its parent */
		setpgid(0, 0);
		prctl(PR_SET_PDEATHSIG, SIGUSR2);
		char c;
		read(p[0], &c, 1);
		pid_t pp = getppid();
		int sig = 0;
		prctl(PR_GET_PDEATHSIG, &sig);
		write(q[1], &pp, sizeof pp);
		write(q[1], &sig, sizeof sig);
		pause();
	}
	pid_t zombie = fork();
	if (zombie == 0)
		_exit(7);
	setpgid(sleeper, sleeper);
	siginfo_t si;
	MUST(waitid(P_PID, zombie, &si, WEXITED | WNOWAIT));  /* exited, not reaped */
	ready();
	wait_term();
	MUST(write(p[1], "?", 1));
	pid_t pp = 0;
	int sig = 0;
	read(q[0], &pp, sizeof pp);
	read(q[0], &sig, sizeof sig);
	EQ("the child's getppid", pp, me);
	EQ("the child's PDEATHSIG", sig, SIGUSR2);
	EQ("the child's process group", getpgid(sleeper), sleeper);
	EQ("the child's session", getsid(sleeper), getsid(0));
	char path[64];
	snprintf(path, sizeof path, "/proc/%d/stat", zombie);
	const char *st = strrchr(slurp(path), ')');
	CHAREQ("the zombie is a zombie (state Z)", st ? st[2] : '?', 'Z');
	int status = 0;
	EQ("wait() for the zombie", waitpid(zombie, &status, WNOHANG), zombie);
	EQ("its exit status", WIFEXITED(status) ? WEXITSTATUS(status) : -1, 7);
	kill(sleeper, SIGKILL);
	EQ("wait() for the killed child", waitpid(sleeper, &status, 0), sleeper);
	EQ("its signal", WIFSIGNALED(status) ? WTERMSIG(status) : -1, SIGKILL);
	return report();
}
