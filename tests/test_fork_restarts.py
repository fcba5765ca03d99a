"""Calls blocked at the fork whose rest the kernel keeps in the task's restart block (poll, a
relative nanosleep, a timed futex wait): the source's go on as the kernel restarts them; in a
child they are made again (a recreated thread has no copy of its source's restart block), never
cut short with EINTR. Each call is made once, as sleep(3) or a poll loop without EINTR handling
would, and reports how it ended and when."""

from __future__ import annotations

import time

import pytest

import bunshin

from conftest import fork_by, wait_file

WAIT = 4.0

C_CALLS = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <linux/futex.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double wait_s, started;
static int word;

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static struct timespec span(double s)
{
	return (struct timespec){(time_t)s, (long)((s - (time_t)s) * 1e9)};
}

static void say(const char *name, long rc, int err)
{
	char path[64], tmp[64];
	snprintf(path, sizeof path, "/tmp/r-%s", name);
	snprintf(tmp, sizeof tmp, "%s.part", path);
	FILE *f = fopen(tmp, "w");
	fprintf(f, "%ld %s %.3f\n", rc, rc < 0 ? strerror(err) : "-", now() - started);
	fclose(f);
	rename(tmp, path);
}

static void *call(void *a)
{
	long i = (long)a, rc;
	struct timespec t = span(wait_s), rem;
	if (i == 0) {
		rc = poll(0, 0, (int)(wait_s * 1000));
		say("poll", rc, errno);
	} else if (i == 1) {
		rc = nanosleep(&t, &rem);  /* as sleep(3): once, the time left kept apart */
		say("nanosleep", rc, errno);
	} else if (i == 2) {
		rc = nanosleep(&t, 0);  /* as usleep(3) */
		say("nanosleep_norem", rc, errno);
	} else if (i == 3) {
		rc = syscall(SYS_futex, &word, FUTEX_WAIT_PRIVATE, 0, &t, 0, 0);
		say("futex_relative", rc, errno);
	} else {
		struct timespec end;
		clock_gettime(CLOCK_MONOTONIC, &end);
		end.tv_sec += (time_t)wait_s;
		rc = syscall(SYS_futex, &word, FUTEX_WAIT_BITSET_PRIVATE, 0, &end, 0, FUTEX_BITSET_MATCH_ANY);
		say("futex_absolute", rc, errno);
	}
	return 0;
}

int main(int argc, char **argv)
{
	wait_s = atof(argv[1]);
	started = now();
	pthread_t t;
	for (long i = 0; i < 5; i++)
		pthread_create(&t, 0, call, (void *)i);
	FILE *f = fopen("/tmp/ready.part", "w");
	fprintf(f, "%.6f\n", started);
	fclose(f);
	rename("/tmp/ready.part", "/tmp/ready");
	long rc = poll(0, 0, (int)(wait_s * 1000));
	say("main_poll", rc, errno);
	sleep(1000);
}
"""

# how each call ends when left alone, and whether the kernel's deadline is kept exactly in a
# child (else it is late by at most the time from its start to the child's first run): the
# main thread's clone has a copy of its source's restart block, other threads none
CALLS = {"poll": ("0 -", False), "nanosleep": ("0 -", False), "nanosleep_norem": ("0 -", False),
         "futex_relative": ("-1 Connection timed out", False),
         "futex_absolute": ("-1 Connection timed out", True), "main_poll": ("0 -", True)}


def _results(w) -> dict[str, tuple[str, float]]:
    out = {}
    for name in CALLS:
        rc, _, at = wait_file(w, f"/tmp/r-{name}", WAIT + 20).strip().rpartition(" ")
        out[name] = (rc, float(at))
    return out


def _start(family) -> tuple[bunshin.Workspace, float]:
    """The program running in a new workspace, and when it started (CLOCK_MONOTONIC)."""
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.write_file("/t.c", C_CALLS)
    assert ws.run("gcc -O1 -pthread -o /t /t.c").ok
    ws.spawn(["/t", str(WAIT)])
    started = float(wait_file(ws, "/tmp/ready"))
    time.sleep(1.0)  # every call entered, and waited long enough for a restart to show
    return ws, started


def _check(w, forked_by: float, exact_in_source: bool) -> None:
    """Every call ended as left alone; ``forked_by``: seconds from the program's start to the
    end of its last fork."""
    for name, (rc, at) in _results(w).items():
        want, exact = CALLS[name]
        assert rc == want, f"{name} in {w.id}: {rc}, after {at:.3f} s"
        if exact or exact_in_source:
            assert WAIT - 0.05 <= at <= WAIT + 0.3, f"{name} in {w.id}: after {at:.3f} s"
        else:  # made again: never early, late by at most the time it had waited at the fork
            assert WAIT - 0.05 <= at <= WAIT + forked_by + 0.5, f"{name} in {w.id}: after {at:.3f} s"


@pytest.mark.parametrize("path", ["ws_fork", "tpl_fork"])
def test_a_call_blocked_at_the_fork_is_made_again_in_the_child(family, path):
    ws, started = _start(family)
    kid = fork_by(ws, path)
    family.append(kid)
    forked_by = time.monotonic() - started
    _check(kid, forked_by, exact_in_source=False)
    _check(ws, 0, exact_in_source=True)


def test_calls_restarted_by_earlier_forks_are_made_again_in_later_children(family):
    """After its first fork a source thread's call runs on as restart_syscall: later forks see
    only that number, and still make the original call again."""
    ws, started = _start(family)
    kids = []
    for _ in range(3):
        (kid,) = ws.fork(1)
        family.append(kid)
        kids.append(kid)
        time.sleep(0.1)  # the source runs: its calls restart
    forked_by = time.monotonic() - started
    for kid in kids:
        _check(kid, forked_by, exact_in_source=False)
    _check(ws, 0, exact_in_source=True)


C_SIGNALLED = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void on_usr1(int sig) { (void)sig; }

static void *call(void *a)
{
	(void)a;
	FILE *f = fopen("/tmp/tid", "w");
	fprintf(f, "%d\n", gettid());
	fclose(f);
	int rc = poll(0, 0, 60000);
	f = fopen("/tmp/r-poll.part", "w");
	fprintf(f, "%d %s\n", rc, rc < 0 ? strerror(errno) : "-");
	fclose(f);
	rename("/tmp/r-poll.part", "/tmp/r-poll");
	return 0;
}

int main(void)
{
	signal(SIGUSR1, on_usr1);
	pthread_t t;
	pthread_create(&t, 0, call, 0);
	for (;;)
		pause();
}
"""


def test_a_call_a_signal_queued_to_its_thread_ends_returns_eintr_in_both(family):
    """A signal queued to the blocked thread itself (here while its process is stopped) ends
    the call with EINTR once its handler has run: so in the child as in the source."""
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.write_file("/t.c", C_SIGNALLED)
    assert ws.run("gcc -O1 -pthread -o /t /t.c").ok
    main = ws.spawn(["/t"])
    tid = int(wait_file(ws, "/tmp/tid"))
    time.sleep(0.2)  # in poll
    ws.kill(main, 19)
    deadline = time.monotonic() + 10
    while ws.run(f"grep -q '^State:.T' /proc/{main}/status").exit_code:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    tgkill = f"import ctypes; assert ctypes.CDLL(None).syscall(234, {main}, {tid}, 10) == 0"
    assert ws.run(f"python3 -c '{tgkill}'").ok
    (kid,) = ws.fork(1)
    family.append(kid)
    for w in (kid, ws):
        w.kill(main, 18)
        assert wait_file(w, "/tmp/r-poll", 10).strip() == "-1 Interrupted system call", w.id
