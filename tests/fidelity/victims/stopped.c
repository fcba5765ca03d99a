/* fidelity: a process stopped by a signal stays stopped; SIGCONT resumes it where it stopped */
#include "../victim.h"
#include <sys/wait.h>

static char state(pid_t pid)
{
	char p[64];
	snprintf(p, sizeof p, "/proc/%d/stat", pid);
	const char *s = strrchr(slurp(p), ')');
	return s ? s[2] : '?';
}

int main(void)
{
	fid_init();
	int p[2];
	MUST(pipe(p));
	pid_t kid = fork();
	if (kid == 0) {
		raise(SIGSTOP);
		write(p[1], "resumed", 7);
		pause();
	}
	int st;
	MUST(waitpid(kid, &st, WUNTRACED));   /* the stop is reported: no longer waiting in the kernel */
	ready();
	wait_term();
	CHAREQ("stopped (state T)", state(kid), 'T');
	fcntl(p[0], F_SETFL, O_NONBLOCK);
	char buf[8] = {0};
	EQ("nothing written while stopped", read(p[0], buf, sizeof buf), -1);
	kill(kid, SIGCONT);
	fcntl(p[0], F_SETFL, 0);
	struct timespec pause_ = {0, 10000000};
	for (int i = 0; i < 200 && state(kid) == 'T'; i++)
		nanosleep(&pause_, 0);
	EQ("it resumed and wrote", read(p[0], buf, 7), 7);
	STREQ("what it wrote", buf, "resumed");
	for (int i = 0; i < 200 && state(kid) == 'R'; i++)  /* on its way to pause() */
		nanosleep(&pause_, 0);
	CHAREQ("sleeping in pause() (state S)", state(kid), 'S');
	kill(kid, SIGKILL);
	return report();
}
