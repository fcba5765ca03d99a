"""Threads survive a fork: every thread of every process is recreated in the child."""

from __future__ import annotations

import time

import bunshin

C_THREADS = r"""
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <unistd.h>
#define N 16
static volatile unsigned long count[N];
static void *work(void *arg) { long i = (long)arg; for (;;) { count[i]++; if (count[i] % 4096 == 0) usleep(100); } }
static void report(int sig) {
    FILE *f = fopen("/tmp/counts", "w");
    for (int i = 0; i < N; i++) fprintf(f, "%lu\n", count[i]);
    fclose(f);
}
int main(void) {
    signal(SIGUSR1, report);
    pthread_t t[N];
    for (long i = 0; i < N; i++) pthread_create(&t[i], 0, work, (void *)i);
    FILE *f = fopen("/tmp/started", "w"); fclose(f);
    for (;;) pause();
}
"""

PY_THREADS = r"""
import os, signal, threading, time
hits = []
def worker(i):
    while True:
        hits.append(i)
        if len(hits) > 100000:
            del hits[:50000]
        time.sleep(0.001)
ts = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(4)]
for t in ts:
    t.start()
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
open("/tmp/started", "w").close()
while True:
    signal.sigwait([signal.SIGUSR1])
    ids = sorted(t.native_id for t in ts)
    with open("/tmp/report", "w") as f:
        f.write(f"{len(hits)} {' '.join(map(str, ids))} {threading.active_count()}\n")
"""


def _wait(w, cmd: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not w.run(cmd).ok:
        assert time.monotonic() < deadline, cmd
        time.sleep(0.05)


def _counts(w, pid):
    w.run("rm -f /tmp/counts")
    w.kill(pid, 10)
    _wait(w, "test -s /tmp/counts")
    time.sleep(0.05)
    return [int(x) for x in w.read_file("/tmp/counts").split()]


def test_c_program_with_16_threads_keeps_running_in_child(no_leaks):
    with bunshin.Workspace.create() as ws:
        ws.write_file("/t.c", C_THREADS)
        assert ws.run("gcc -O1 -pthread -o /t /t.c").ok
        pid = ws.spawn(["/t"])
        _wait(ws, "test -e /tmp/started")
        (kid,) = ws.fork(1)
        try:
            for w in (ws, kid):
                task = sorted(int(x) for x in w.run(f"ls /proc/{pid}/task").stdout.split())
                assert len(task) == 17 and task[0] == pid
                a = _counts(w, pid)
                time.sleep(0.3)
                b = _counts(w, pid)
                assert all(y > x for x, y in zip(a, b)), (a, b)
            # the same thread ids inside both workspaces
            assert ws.run(f"ls /proc/{pid}/task").stdout == kid.run(f"ls /proc/{pid}/task").stdout
        finally:
            kid.close()


def test_python_threads_keep_running_with_their_ids(no_leaks):
    with bunshin.Workspace.create() as ws:
        ws.write_file("/thr.py", PY_THREADS)
        pid = ws.spawn(["python3", "/thr.py"])
        _wait(ws, "test -e /tmp/started")
        (kid,) = ws.fork(1)
        try:
            reports = {}
            for w in (ws, kid):
                for _ in range(2):
                    w.run("rm -f /tmp/report")
                    w.kill(pid, 10)
                    _wait(w, "test -s /tmp/report")
                    reports.setdefault(w.id, []).append(w.read_file("/tmp/report").split())
                    time.sleep(0.2)
            (a1, a2), (b1, b2) = reports[ws.id], reports[kid.id]
            assert a1[1:5] == b1[1:5]  # same native thread ids in parent and child
            assert a1[5] == b1[5] == b"5"  # main + 4 workers alive
            assert int(b2[0]) != int(b1[0]) or int(a2[0]) != int(a1[0])  # workers still appending
        finally:
            kid.close()


def test_forks_of_a_threaded_process_fit_under_the_pids_limit(family):
    """A clone is born in the template's cgroup and moved into its child's before its threads
    are recreated: four forks of a 17-task process need room for four clones and their
    intermediates under the template's pids limit, not for all their threads."""
    ws = bunshin.Workspace.create(pids_limit=18 + 4 + 4 + 2)
    family.append(ws)
    ws.write_file("/idle.py", IDLE_THREADS)
    pid = ws.spawn(["python3", "/idle.py"])
    _wait(ws, "test -e /tmp/started")
    tpl = ws.snapshot()
    try:
        assert tpl._core.body.cgroup.stats().pids_current == 18  # init, and 17 threads
        kids = tpl.fork(4)
        family += kids
        for k in kids:
            assert len(k.run(f"ls /proc/{pid}/task").stdout.split()) == 17
            assert k.cgroup.stats().pids_current == 18
    finally:
        tpl.close()


# 16 threads that wait, beside the main one: tasks that cost no CPU in five workspaces
IDLE_THREADS = r"""
import threading, time
for _ in range(16):
    threading.Thread(target=time.sleep, args=(1e6,), daemon=True).start()
open("/tmp/started", "w").close()
time.sleep(1e6)
"""
