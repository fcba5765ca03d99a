"""Two processes (not threads of one) sharing a kernel object through clone()'s flags cannot be
carried, as a clone gets each object of its own and no system call joins another process's
(plan.SHARINGS): a fork refuses them up front, naming both, and the source runs on unchanged.
CLONE_IO is the exception, carried without its sharing (scheduling only): the pair forks, each
clone with its process's I/O priority. CLONE_FILES: test_fork_fd_tables.py."""

from __future__ import annotations

import time

import pytest

import bunshin
from bunshin.errors import ForkError

from conftest import fork_by, wait_file

C_SHARERS = r"""
#define _GNU_SOURCE
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static char stack[65536] __attribute__((aligned(16)));
static pid_t kid;

static int sharer(void *a)
{
	(void)a;
	for (;;)
		pause();
	return 0;
}

/* its own I/O priority and the sharer's, for the test to compare */
static void say_ioprio(int sig)
{
	(void)sig;
	FILE *f = fopen("/tmp/ioprio.part", "w");
	fprintf(f, "%ld %ld\n", syscall(SYS_ioprio_get, 1, 0), syscall(SYS_ioprio_get, 1, kid));
	fclose(f);
	rename("/tmp/ioprio.part", "/tmp/ioprio");
}

int main(int argc, char **argv)
{
	int flags = strtol(argv[1], 0, 0);
	signal(SIGUSR1, say_ioprio);
	if (flags & CLONE_IO)  /* the kernel makes an I/O context only on demand: one to share */
		syscall(SYS_ioprio_set, 1, 0, (2 << 13) | 4);
	kid = clone(sharer, stack + sizeof stack, flags | SIGCHLD, 0);
	FILE *f = fopen("/tmp/sharer", "w");
	fprintf(f, "%d\n", kid);
	fclose(f);
	fclose(fopen("/tmp/ready", "w"));
	for (;;)
		pause();
}
"""

CLONE_VM, CLONE_FS, CLONE_SIGHAND, CLONE_PARENT, CLONE_SYSVSEM, CLONE_IO = (
    0x100, 0x200, 0x800, 0x8000, 0x40000, 0x80000000)

REFUSED = {
    "fs": (CLONE_FS, r"file system context \(clone with CLONE_FS\)"),
    "sighand": (CLONE_VM | CLONE_SIGHAND, r"set of signal handlers \(clone with CLONE_SIGHAND\)"),
    "sysvsem": (CLONE_SYSVSEM, r"SysV semaphore undo list \(clone with CLONE_SYSVSEM\)"),
    "vm": (CLONE_VM | CLONE_PARENT, r"address space \(clone with CLONE_VM\)"),
    "vm_child": (CLONE_VM, r"address space \(clone with CLONE_VM\)"),  # its parent is not in vfork
}


def _start(family, flags: int):
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.write_file("/t.c", C_SHARERS)
    assert ws.run("gcc -O1 -o /t /t.c").ok
    main = ws.spawn(["/t", str(flags)])
    wait_file(ws, "/tmp/ready")
    return ws, main, int(wait_file(ws, "/tmp/sharer"))


@pytest.mark.parametrize("path", ["ws_fork", "snapshot"])
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_processes_sharing_a_kernel_object_are_refused_naming_both(family, case, path):
    flags, what = REFUSED[case]
    ws, main, sharer = _start(family, flags)
    procs = sorted(p.pid for p in ws.processes())
    began = time.monotonic()
    with pytest.raises(ForkError, match=rf"processes {main} \(t\) and {sharer} \(t\) share one {what}") as e:
        ws.fork(1) if path == "ws_fork" else ws.snapshot()
    assert e.value.step == "plan"
    assert time.monotonic() - began < 1.5  # refused at once, not after a vfork's wait
    assert sorted(p.pid for p in ws.processes()) == procs
    assert not ws.cgroup.frozen()
    ws.kill(sharer, 9)
    while any(p.pid == sharer and p.state != "Z" for p in ws.processes()):
        time.sleep(0.01)
    (kid,) = ws.fork(1)  # without the sharer, it forks
    family.append(kid)
    # the sharer's zombie too: zombies are carried
    assert sorted(p.pid for p in kid.processes()) == sorted(p.pid for p in ws.processes())


@pytest.mark.parametrize("path", ["ws_fork", "tpl_fork"])
def test_processes_sharing_an_io_context_fork_with_their_io_priority(family, path):
    ws, main, sharer = _start(family, CLONE_IO)
    kid = fork_by(ws, path)
    family.append(kid)
    best_effort_4 = (2 << 13) | 4
    for w in (kid, ws):
        w.kill(main, 10)
        assert wait_file(w, "/tmp/ioprio").split() == [str(best_effort_4)] * 2
        w.run("rm /tmp/ioprio")
    assert sorted(p.pid for p in kid.processes()) == sorted(p.pid for p in ws.processes())
