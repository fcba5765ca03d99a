/* fidelity: signal dispositions (handlers, their flags and masks, ignored signals) and the mask */
#include "../victim.h"

static volatile int hits[3];
static volatile int info_value;
static void on_usr1(int s) { (void)s; hits[0]++; }
static void on_usr2(int s, siginfo_t *si, void *c) { (void)s; (void)c; hits[1]++; info_value = si->si_value.sival_int; }
static void on_hup(int s) { (void)s; hits[2]++; }

int main(void)
{
	fid_init();
	struct sigaction a = {.sa_handler = on_usr1, .sa_flags = SA_RESTART};
	sigemptyset(&a.sa_mask);
	sigaddset(&a.sa_mask, SIGWINCH);
	MUST(sigaction(SIGUSR1, &a, 0));
	struct sigaction b = {.sa_sigaction = on_usr2, .sa_flags = SA_SIGINFO | SA_NODEFER};
	MUST(sigaction(SIGUSR2, &b, 0));
	struct sigaction c = {.sa_handler = on_hup, .sa_flags = SA_RESETHAND};
	MUST(sigaction(SIGHUP, &c, 0));
	signal(SIGINT, SIG_IGN);
	signal(SIGQUIT, SIG_IGN);
	sigset_t m;
	sigemptyset(&m);
	sigaddset(&m, SIGRTMIN + 9);
	sigaddset(&m, SIGPIPE);
	sigprocmask(SIG_BLOCK, &m, 0);
	ready();
	wait_term();
	struct sigaction got;
	sigaction(SIGUSR1, 0, &got);
	CHECK(got.sa_handler == on_usr1, "SIGUSR1 handler");
	EQ("SIGUSR1 SA_RESTART", got.sa_flags & SA_RESTART, SA_RESTART);
	EQ("SIGUSR1 handler's mask has SIGWINCH", sigismember(&got.sa_mask, SIGWINCH), 1);
	sigaction(SIGUSR2, 0, &got);
	CHECK(got.sa_sigaction == on_usr2, "SIGUSR2 handler");
	EQ("SIGUSR2 flags", got.sa_flags & (SA_SIGINFO | SA_NODEFER | SA_RESTART), SA_SIGINFO | SA_NODEFER);
	sigaction(SIGHUP, 0, &got);
	EQ("SIGHUP SA_RESETHAND", got.sa_flags & SA_RESETHAND, SA_RESETHAND);
	sigaction(SIGINT, 0, &got);
	CHECK(got.sa_handler == SIG_IGN, "SIGINT not ignored");
	sigaction(SIGQUIT, 0, &got);
	CHECK(got.sa_handler == SIG_IGN, "SIGQUIT not ignored");
	sigaction(SIGCHLD, 0, &got);
	CHECK(got.sa_handler == SIG_DFL, "SIGCHLD not default");
	sigset_t now_;
	sigprocmask(SIG_BLOCK, 0, &now_);
	EQ("blocks SIGRTMIN+9", sigismember(&now_, SIGRTMIN + 9), 1);
	EQ("blocks SIGPIPE", sigismember(&now_, SIGPIPE), 1);
	EQ("blocks SIGUSR1", sigismember(&now_, SIGUSR1), 0);
	raise(SIGUSR1);
	sigqueue(getpid(), SIGUSR2, (union sigval){.sival_int = 5});
	raise(SIGHUP);
	EQ("SIGUSR1 handled", hits[0], 1);
	EQ("SIGUSR2 handled", hits[1], 1);
	EQ("SIGUSR2's value", info_value, 5);
	EQ("SIGHUP handled", hits[2], 1);
	sigaction(SIGHUP, 0, &got);
	CHECK(got.sa_handler == SIG_DFL, "SIGHUP's handler not reset after a delivery");
	return report();
}
