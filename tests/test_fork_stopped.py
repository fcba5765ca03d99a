"""A process stopped by a signal (``kill -STOP``, a shell job suspended with Ctrl-Z) forks
stopped: the fork returns at once, the process stays stopped in the source, its clone is
stopped too, and SIGCONT resumes either where it stopped. The cgroup freezer would otherwise
keep the fork's attach to it waiting for ever."""

from __future__ import annotations

import glob
import os
import signal
import threading
import time

import pytest
from conftest import SCRIPT_PRELUDE, leaks, wait_file, ws_status

import bunshin
from bunshin import config
from bunshin.compel import Tracee
from bunshin.errors import CheckpointError, CriuError, ForkError
from bunshin.fork import seize
from bunshin.fork.plan import proc_status
from bunshin.runtime import cgroup

BOUND = 30.0  # seconds any one call below may take (a hang is released by thawing, then fails)

# A counter in a second thread (the main thread only waits): its count lives in memory only,
# so a resumed copy that goes on from the count it stopped at kept its memory.
COUNTER = SCRIPT_PRELUDE + """
import threading
n = 0
def count():
    global n
    while True:
        n += 1
        out('/count', str(n))
        time.sleep(0.02)
threading.Thread(target=count).start()
threading.Event().wait()
"""


def bounded(call):
    """``(call()'s result, seconds it took)``, failing the test if it takes more than BOUND
    seconds; a call that hangs is released (every frozen group of this session thawed, the
    templates' too) before the test fails."""
    box = {}

    def run():
        try:
            box["out"] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            box["err"] = e

    t = threading.Thread(target=run, daemon=True)
    start = time.monotonic()
    t.start()
    t.join(BOUND)
    if t.is_alive():
        top = config.cgroup_prefix()
        for path, thawed in ((f"/sys/fs/cgroup/freezer/{top}/*/freezer.state", "THAWED"),
                             (f"/sys/fs/cgroup/{top}/*/cgroup.freeze", "0")):  # v1, v2
            for state_file in glob.glob(path):
                with open(state_file, "w") as f:
                    f.write(thawed)
        t.join(BOUND)
        pytest.fail(f"the call did not return within {BOUND} s")
    if "err" in box:
        raise box["err"]
    return box["out"], time.monotonic() - start


def state(w, pid: int) -> str:
    return ws_status(w, pid, "State")[0]


def until_state(w, pid: int, want: str, timeout: float = 5) -> str:
    """``pid``'s state in ``w`` once it is ``want`` (or, at the timeout, whatever it is). A
    process let go in its stop, or with a SIGSTOP pending, stops before its next user
    instruction: soon, but not at once."""
    deadline = time.monotonic() + timeout
    while state(w, pid) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return state(w, pid)


def host_pid(w, pid: int) -> int:
    return next(hp for hp in w.host_pids() if proc_status(hp)["NSpid"].split()[-1] == str(pid))


def count(w) -> int:
    return int(w.read_file("/count"))


def counting_stopped(family):
    """A workspace whose counter runs, then is stopped; returns it, the counter's pid and the
    count it stopped at."""
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.write_file("/t.py", COUNTER)
    pid = ws.spawn(["python3", "/t.py"])
    wait_file(ws, "/count")
    ws.kill(pid, signal.SIGSTOP)
    assert until_state(ws, pid, "T") == "T"
    # State is the main thread's: the counting thread stops too, later on a loaded machine
    hp = host_pid(ws, pid)
    deadline = time.monotonic() + 10
    while not all(proc_status(f"{hp}/task/{t}")["State"][0] == "T" for t in os.listdir(f"/proc/{hp}/task")):
        assert time.monotonic() < deadline, "the counting thread never stopped"
        time.sleep(0.01)
    return ws, pid, count(ws)


def _threads(w, pid: int) -> dict:
    """Each thread's state, tracer and call, for a failure to show where a thread was held."""
    hp = host_pid(w, pid)
    out = {}
    for t in os.listdir(f"/proc/{hp}/task"):
        st = proc_status(f"{hp}/task/{t}")
        try:
            call = open(f"/proc/{hp}/task/{t}/syscall").read().split()[:1]
        except OSError:
            call = []
        out[t] = (st["State"], st.get("TracerPid"), call)
    return out


def assert_stopped_then_resumes(w, pid: int, at: int) -> None:
    """``pid`` in ``w`` is stopped at count ``at``, and counts on from there after SIGCONT."""
    assert until_state(w, pid, "T") == "T"
    time.sleep(0.1)
    assert count(w) == at  # stopped: not a step further
    w.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while count(w) < at + 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    now = count(w)
    assert at + 3 <= now < at + 1000, (at, now, _threads(w, pid))  # went on from where it stopped
    assert state(w, pid) in "SR"


@pytest.mark.parametrize("how", ["ws.fork", "tpl.fork"])
def test_a_stopped_process_forks_stopped(family, how):
    ws, pid, at = counting_stopped(family)
    if how == "ws.fork":
        kids, took = bounded(lambda: ws.fork(1))
    else:
        tpl, _ = bounded(ws.snapshot)
        try:
            kids, took = bounded(lambda: tpl.fork(1))
            family.extend(kids)
            more, _ = bounded(lambda: tpl.fork(1))  # its processes held since the first
            kids += more
            # let go (detached while frozen, back in their stop only once thawed), seized again
            tpl._core.let_go()
            more, _ = bounded(lambda: tpl.fork(1))
            kids += more
        finally:
            family.extend(kids)
            tpl.close()
    family.extend(kids)
    assert took < BOUND
    for w in [ws, *kids]:
        assert_stopped_then_resumes(w, pid, at)


def test_a_shell_job_suspended_with_ctrl_z_forks_suspended(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    sh = ws.shell()
    ws.write_file("/t.py", COUNTER)
    sh.run("python3 /t.py & echo $! > /job.pid")
    wait_file(ws, "/count")
    pid = int(ws.read_file("/job.pid"))
    sh.run("kill -TSTP %1")  # what Ctrl-Z sends the foreground job
    assert until_state(ws, pid, "T") == "T"
    time.sleep(0.1)  # as in counting_stopped
    at = count(ws)
    (kid,), _ = bounded(lambda: ws.fork(1))
    family.append(kid)
    for w in [ws, kid]:
        s = w.shells[0]
        assert until_state(w, pid, "T") == "T"
        assert b"Stopped" in s.run("jobs").stdout
        time.sleep(0.1)
        assert count(w) == at
        s.run("kill -CONT %1")  # as bg would: the job's group, found by the shell
        deadline = time.monotonic() + 10
        while count(w) < at + 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert at + 3 <= count(w) < at + 1000
        assert state(w, pid) in "SR"


def test_a_process_that_never_reaches_its_stop_fails_the_fork_cleanly(family, monkeypatch):
    ws, pid, at = counting_stopped(family)
    other = ws.spawn(["sleep", "1000"])
    before = {k: v for k, v in leaks().items() if k != "inits"}
    real, stuck = Tracee._await_report, host_pid(ws, pid)

    def never(self, timeout):
        if self.pid == stuck:  # as the real wait says of a task that never stops
            raise ForkError(f"pid {self.pid}: no ptrace stop within {timeout:g} s", pid=self.pid,
                            step="wait")
        return real(self, timeout)

    monkeypatch.setattr(Tracee, "_await_report", never)
    with pytest.raises(ForkError, match=rf"process {pid} \(python3\) did not reach a ptrace stop"):
        bounded(lambda: ws.fork(1))
    monkeypatch.undo()
    assert {k: v for k, v in leaks().items() if k != "inits"} == before
    # nothing left attached: the one waited for in vain is let go once it is seen stopped
    deadline = time.monotonic() + 5
    while any(proc_status(hp)["TracerPid"] != "0" for hp in ws.host_pids()):
        assert time.monotonic() < deadline, "a process is still attached"
        time.sleep(0.01)
    assert ws.run(f"kill -0 {other} && echo alive").stdout == b"alive\n"  # thawed, running
    assert_stopped_then_resumes(ws, pid, at)


def test_where_wchan_tells_nothing_a_stopped_process_forks_or_fails_in_bounded_time(family,
                                                                                     monkeypatch):
    """A kernel without kallsyms: nothing tells a stopped process from the others while frozen.
    The cgroup v1 freezer holds it frozen in its stop, so its attach waits for the thaw: a timer
    thaws the group and the fork fails, naming it. The v2 freezer leaves it in its stop (a
    stopped task counts as frozen there), so its attach takes it to a ptrace stop at once and
    it forks stopped."""
    ws, pid, at = counting_stopped(family)
    before = {k: v for k, v in leaks().items() if k != "inits"}
    monkeypatch.setattr(seize, "in_group_stop", lambda pid: None)
    monkeypatch.setattr(seize, "STOP_TIMEOUT", 3.0)  # the stopped one never stops; the others, even on a loaded machine
    if cgroup.backend().name == "v2":
        (kid,), _ = bounded(lambda: ws.fork(1))
        family.append(kid)
        monkeypatch.undo()
        for w in (ws, kid):
            assert_stopped_then_resumes(w, pid, at)
        return
    with pytest.raises(ForkError, match=rf"process {pid} \(python3\): its ptrace attach did not"):
        bounded(lambda: ws.fork(1))
    monkeypatch.undo()
    assert {k: v for k, v in leaks().items() if k != "inits"} == before
    for hp in ws.host_pids():
        assert proc_status(hp)["TracerPid"] == "0"
    assert_stopped_then_resumes(ws, pid, at)
    (kid,), _ = bounded(lambda: ws.fork(1))  # resumed, it forks
    family.append(kid)
    assert until_state(kid, pid, "S") in "SR"


def test_dump_refuses_a_stopped_process_and_leaves_it_stopped(family, tmp_path):
    try:
        from bunshin.criu import runner

        runner.criu()
    except CriuError as e:
        pytest.skip(f"no usable CRIU >= 4 ({e})")
    from bunshin import criu

    ws, pid, at = counting_stopped(family)
    with pytest.raises(CheckpointError, match=r"process \d+ \(python3\) is stopped by a signal"):
        bounded(lambda: criu.dump_workspace(ws, tmp_path / "img"))
    assert not (tmp_path / "img").exists()
    assert_stopped_then_resumes(ws, pid, at)
