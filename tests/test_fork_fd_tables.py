"""Two processes sharing one descriptor table (clone with CLONE_FILES) cannot be carried: a
clone gets a table of its own, and no system call makes a process take another's. A fork
refuses them up front, naming both, and the source runs on with its table still shared."""

from __future__ import annotations

import time

import pytest

import bunshin
from bunshin.errors import ForkError

from conftest import wait_file

C_SHARERS = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <unistd.h>

static char stack[65536] __attribute__((aligned(16)));

/* says when a descriptor the other process opened shows in its table */
static int sharer(void *a)
{
	(void)a;
	while (fcntl(100, F_GETFD) == -1)
		usleep(10000);
	fclose(fopen("/tmp/sees-100", "w"));
	pause();
	return 0;
}

static void open_100(int sig)
{
	(void)sig;
	dup2(open("/dev/null", O_RDONLY), 100);
}

int main(void)
{
	signal(SIGUSR1, open_100);
	FILE *f = fopen("/tmp/sharer", "w");
	fprintf(f, "%d\n", clone(sharer, stack + sizeof stack, CLONE_FILES | SIGCHLD, 0));
	fclose(f);
	if (fork() == 0)  /* the same descriptors in a table of its own: not refused */
		for (;;)
			pause();
	fclose(fopen("/tmp/ready", "w"));
	for (;;)
		pause();
}
"""


@pytest.mark.parametrize("path", ["ws_fork", "snapshot"])
def test_processes_sharing_a_descriptor_table_are_refused_naming_both(family, path):
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.write_file("/t.c", C_SHARERS)
    assert ws.run("gcc -O1 -o /t /t.c").ok
    main = ws.spawn(["/t"])
    wait_file(ws, "/tmp/ready")
    sharer = int(wait_file(ws, "/tmp/sharer"))
    procs = sorted(p.pid for p in ws.processes())
    with pytest.raises(ForkError, match=rf"processes {main} \(t\) and {sharer} \(t\) share one "
                                        r"descriptor table \(clone with CLONE_FILES\)") as e:
        ws.fork(1) if path == "ws_fork" else ws.snapshot()
    assert e.value.step == "plan"
    assert sorted(p.pid for p in ws.processes()) == procs
    assert not ws.cgroup.frozen()
    ws.kill(main, 10)
    wait_file(ws, "/tmp/sees-100")  # still one table
    ws.kill(sharer, 9)
    while any(p.pid == sharer and p.state != "Z" for p in ws.processes()):
        time.sleep(0.01)
    (kid,) = ws.fork(1)  # without the sharer, it forks
    family.append(kid)
    # the sharer's zombie too (a zombie holds no descriptor table)
    assert sorted((p.pid, p.state == "Z") for p in kid.processes()) == \
        sorted((p.pid, p.state == "Z") for p in ws.processes())
