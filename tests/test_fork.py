"""BunshinFork with real programs: process trees, PIDs, files, pipes, terminals, memory."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from conftest import fork_by, signal_and_read, wait_file, wait_for_bytes, ws_status

import bunshin
from bunshin.errors import ForkError
from bunshin.fork.plan import proc_status
from bunshin.runtime import layers


def test_fork_keeps_processes_pids_and_shell_state(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    sh = ws.shell()
    sh.run("cd /tmp && X=42 && greet() { echo hi $1; } && umask 027 && ulimit -n 777")
    sh.run("sleep 1000 & echo $! > /tmp/bg.pid")
    srv = ws.spawn(["python3", "-c", "import time\nwhile True: time.sleep(0.05)"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the background job and srv may not have exec'd yet
        before = {p.pid: p.cmdline for p in ws.processes()}
        if ["sleep", "1000"] in before.values() and before.get(srv, [""])[0] == "python3":
            break
        time.sleep(0.02)
    kids = ws.fork(2)
    family.extend(kids)
    for w in [ws, *kids]:
        assert {p.pid: p.cmdline for p in w.processes()} == before
        s = w.shells[0]
        r = s.run("echo $X $PWD; greet you; umask; ulimit -n; jobs")
        assert r.stdout.decode().splitlines()[:4] == ["42 /tmp", "hi you", "0027", "777"], r
        assert b"Running" in r.stdout and b"sleep 1000" in r.stdout
        assert int(ws_status(w, srv, "PPid")) == 1
        assert w.run(f"kill -0 {srv} && echo alive").stdout == b"alive\n"
    # the clones are distinct processes in distinct pid namespaces
    inits = {os.readlink(f"/proc/{w.init_pid}/ns/pid") for w in [ws, *kids]}
    assert len(inits) == 3
    # the engine pins itself and the tasks to one CPU while it works; nothing stays pinned
    everywhere = os.sched_getaffinity(0)
    for w in [ws, *kids]:
        for hp in w.host_pids():
            for tid in os.listdir(f"/proc/{hp}/task"):
                assert os.sched_getaffinity(int(tid)) == everywhere


def test_files_are_private_after_fork(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.write_file("/work/shared.txt", "base\n")
    (kid,) = ws.fork(1)
    family.append(kid)
    kid.write_file("/work/shared.txt", "child\n")
    ws.run("echo parent-only > /work/p.txt")
    kid.run("rm /work/shared.txt.nope 2>/dev/null; echo c > /work/c.txt")
    assert ws.read_file("/work/shared.txt") == b"base\n"
    assert kid.read_file("/work/shared.txt") == b"child\n"
    assert ws.run("test -e /work/c.txt").exit_code == 1
    assert kid.run("test -e /work/p.txt").exit_code == 1


def test_fork_cost_does_not_copy_written_files(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.run("head -c 50000000 /dev/urandom > /big.bin")
    digest = ws.run("sha256sum /big.bin").stdout.split()[0]
    os.sync()  # the file's blocks allocated: the snapshot would else allocate them in the fork
    state = os.statvfs(ws.body.dir.path)
    (kid,) = ws.fork(1)
    family.append(kid)
    # The child's layer holds no copy: the bytes are in the read-only copy of the source's
    # upper layer, a btrfs snapshot sharing the source's blocks.
    assert not (kid.body.dir.upper / "big.bin").exists()
    after = os.statvfs(ws.body.dir.path)
    if layers.is_subvolume(ws.body.dir.layer):  # elsewhere the copy is a copy
        assert (state.f_bfree - after.f_bfree) * after.f_frsize < 10 << 20
    for w in (ws, kid):
        assert w.run("sha256sum /big.bin").stdout.split()[0] == digest


def test_open_files_keep_offsets_flags_and_deleted_files(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    sh = ws.shell()
    sh.run("printf 'abcdefgh' > /tmp/r.txt; exec 5</tmp/r.txt; read -n 3 x <&5; echo $x")
    sh.run("exec 6>>/tmp/app.log; echo first >&6")
    sh.run("printf 'ghost data' > /tmp/ghost; exec 8</tmp/ghost; rm /tmp/ghost")
    sh.run("exec 9</tmp")
    (kid,) = ws.fork(1)
    family.append(kid)
    for w, tag in ((ws, "parent"), (kid, "child")):
        s = w.shells[0]
        assert s.run("read -n 2 y <&5; echo $y").stdout == b"de\n"  # offset 3 was kept
        s.run(f"echo {tag} >&6")
        assert s.run("cat <&8").stdout == b"ghost data"  # deleted but open
        assert s.run("ls -l /proc/self/fd/9 | grep -o '/tmp$'").stdout == b"/tmp\n"
    assert ws.read_file("/tmp/app.log") == b"first\nparent\n"
    assert kid.read_file("/tmp/app.log") == b"first\nchild\n"
    assert ws.run("test -e /tmp/ghost").exit_code == 1


def test_pipes_keep_buffered_bytes(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    # a reader that waits for a signal before reading: the bytes sit in the pipe at fork time
    ws.write_file("/reader.sh", "trap 'cat > /tmp/got; exit' USR1\n: > /tmp/trapped\n"
                                "while :; do sleep 0.05; done\n")
    pid = ws.spawn(["sh", "-c", "printf 'queued-bytes' | sh /reader.sh"])
    wait_file(ws, "/tmp/trapped", 30)  # forked before its trap, the reader dies of the signal
    # then the loop runs a while: the fork may land in one of its vforks (the snapshot waits
    # for the exec: test_fork_vfork.py)
    time.sleep(0.5)
    deadline = time.monotonic() + 30
    while True:
        time.sleep(0.05)
        # the loop's own forks show as "sh /reader.sh" until they exec sleep: take the one
        # whose parent is not a reader (a slow guest catches those transient children)
        procs = ws.processes()
        readers = {p.pid: p.ppid for p in procs if p.cmdline[:2] == ["sh", "/reader.sh"]}
        roots = [p for p, pp in readers.items() if pp not in readers]
        writers = [p for p in procs if p.ppid == pid and p.pid not in readers]  # printf's side
        if (len(roots) == 1 and not writers) or time.monotonic() > deadline:
            break
    (reader,) = roots
    (kid,) = ws.fork(1)
    family.append(kid)
    for w in (ws, kid):
        w.kill(reader, 10)
        assert wait_for_bytes(w, "/tmp/got", b"queued-bytes") == b"queued-bytes"
    del pid


def test_python_repl_on_a_fifo_keeps_its_variables(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.run("mkfifo /tmp/in")
    ws.spawn(["sh", "-c", "exec python3 -i -q -u < /tmp/in > /tmp/out 2>&1"])
    ws.spawn(["sh", "-c", "exec sleep 1000 > /tmp/in"])  # keeps a writer: no EOF
    ws.run("echo 'x = 41' > /tmp/in")
    wait_for_bytes(ws, "/tmp/out", b">>> ")
    (kid,) = ws.fork(1)
    family.append(kid)
    ws.run("echo 'print(\"parent\", x)' > /tmp/in")
    kid.run("echo 'print(\"child\", x + 1)' > /tmp/in")
    assert b"parent 41" in wait_for_bytes(ws, "/tmp/out", b"parent 41")
    out = wait_for_bytes(kid, "/tmp/out", b"child 42")
    assert b"child 42" in out and b"parent" not in out


def test_memory_is_shared_copy_on_write(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    code = ("import signal, sys\nb = bytearray(128 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
            "def touch(*_):\n    for i in range(0, len(b), 4096): b[i] = 2\n"
            "    open('/tmp/touched', 'w').close()\n"
            "signal.signal(signal.SIGUSR1, touch)\nopen('/tmp/ready', 'w').close()\n"
            "while True: signal.pause()\n")
    ws.write_file("/hog.py", code)
    pid = ws.spawn(["python3", "/hog.py"])
    deadline = time.monotonic() + 20
    while not ws.run("test -e /tmp/ready").ok and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ws.run("test -e /tmp/ready").ok
    kids = ws.fork(2)
    family.extend(kids)
    u = bunshin.memory.family_usage([ws, *kids])
    mib = 1 << 20
    # one copy of the 128 MiB for the whole family, shared by all three
    assert 128 * mib <= u.total_bytes < 200 * mib, u
    assert u.shared_bytes >= 128 * mib
    for w in (ws, *kids):
        assert u.per_workspace[w.id].private_bytes < 40 * mib
    kids[0].kill(pid, 10)  # the child rewrites every page: its copy becomes private
    wait_file(kids[0], "/tmp/touched", timeout=60)
    u2 = bunshin.memory.family_usage([ws, *kids])
    assert u2.per_workspace[kids[0].id].private_bytes >= 128 * mib
    assert u2.total_bytes >= u.total_bytes + 120 * mib


def test_snapshot_fork_many_and_restore(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    sh = ws.shell()
    sh.run("N=1; echo v1 > /state")
    tpl = ws.snapshot()
    try:
        sh.run("N=2; echo v2 > /state; touch /extra")
        kids = tpl.fork(3)
        family.extend(kids)
        for k in kids:
            assert k.shells[0].run("echo $N; cat /state").stdout == b"1\nv1\n"
        assert sh.run("echo $N; cat /state").stdout == b"2\nv2\n"
        ws.restore(tpl)  # rollback, same object and shell session
        assert sh.run("echo $N; cat /state; test -e /extra || echo no-extra").stdout == b"1\nv1\nno-extra\n"
        assert ws.run("echo ok").stdout == b"ok\n"
    finally:
        tpl.close()
    # children outlive the template handle
    assert family[1].run("cat /state").stdout == b"v1\n"


def test_on_fork_makes_clones_unique(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.write_file("/etc/machine-id", "0" * 32 + "\n")
    seen = []

    def unique(child):
        seen.append(child.id)
        child.write_file("/etc/machine-id", child.id.ljust(32, "0") + "\n")

    kids = ws.fork(3, on_fork=unique)
    family.extend(kids)
    assert seen == [k.id for k in kids]
    ids = {k.run("cat /etc/machine-id").stdout for k in kids}
    assert len(ids) == 3 and ws.read_file("/etc/machine-id") == b"0" * 32 + b"\n"


def test_unsupported_descriptor_fails_cleanly_and_source_survives(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    sh = ws.shell()
    sh.run("X=still-here")
    # a TCP connection still in the listener's backlog (never accepted) cannot be carried
    ws.spawn(["python3", "-c", "import socket, time\ns = socket.socket(); s.bind(('127.0.0.1', 7777)); "
                               "s.listen()\nc = socket.create_connection(('127.0.0.1', 7777))\n"
                               "open('/tmp/connected', 'w').close()\nwhile True: time.sleep(1)"])
    wait_file(ws, "/tmp/connected", timeout=30)  # python starts slowly in a TCG guest
    n_dirs = len(list((ws.state_path.parent).iterdir()))
    with pytest.raises(ForkError, match=r"fd \d+: TCP socket 127.0.0.1:7777 is listening with 1 connection"):
        ws.fork(1)
    assert len(list((ws.state_path.parent).iterdir())) == n_dirs
    assert sh.run("echo $X").stdout == b"still-here\n"
    assert not ws.cgroup.frozen()


def test_concurrent_forks_of_one_template(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.shell().run("V=shared")
    tpl = ws.snapshot()
    out: list = []
    errors: list = []

    def worker():
        try:
            out.extend(tpl.fork(2))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    try:
        ts = [threading.Thread(target=worker) for _ in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        family.extend(out)
        assert not errors and len(out) == 6
        assert len({w.id for w in out}) == 6
        for w in out:
            assert w.shells[0].run("echo $V").stdout == b"shared\n"
    finally:
        tpl.close()


def test_bad_fork_arguments(ws):
    for n in (0, -1, True, 1.5, "2"):
        with pytest.raises(ForkError, match="n must be"):
            ws.fork(n)
    ws.close()
    with pytest.raises(bunshin.WorkspaceClosed):
        ws.fork(1)


def test_a_pipeline_job_keeps_its_process_group(family):
    """A shell's pipeline job is one process group; in a fork its second process joins the
    group its first one's clone made again, so signalling the group reaches both. With the
    module (JOIN_SESSION), or made by the shell's clone (fork/tree.py), both are in the shell's
    clone's session too; in a flat tree they stay in the template shell's session, outside the
    child (NSsid 0)."""
    from bunshin._core import backend
    from bunshin.fork.cloners import cloner

    ws = bunshin.Workspace.create()
    family.append(ws)
    sh = ws.shell()
    sh.run("sleep 1000 | sleep 1001 &")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = {p.cmdline[-1]: p.pid for p in ws.processes() if p.cmdline and p.cmdline[0] == "sleep"}
        if len(pids) == 2:
            break
        time.sleep(0.02)
    lead, other = pids["1000"], pids["1001"]
    assert ws_status(ws, other, "NSpgid") == str(lead)
    (kid,) = ws.fork(1)
    family.append(kid)
    sid = str(sh.pid) if backend().join_session is not None or cloner().exact_tree() else "0"
    for pid in (lead, other):
        assert (ws_status(kid, pid, "NSpgid"), ws_status(kid, pid, "NSsid")) == (str(lead), sid), pid
    kid.run(f"kill -TERM -{lead}")
    deadline = time.monotonic() + 10
    while {lead, other} & {p.pid for p in kid.processes()} and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not {lead, other} & {p.pid for p in kid.processes()}  # the group signal reached both
    assert {lead, other} <= {p.pid for p in ws.processes()}  # the source's own are untouched


def test_parent_links(family):
    """A child workspace's process tree is the source's (with the kernel module's REPARENT;
    without it each clone is made by its parent's clone, fork/tree.py): a shell's background
    job is its child in every fork, and `wait` works. In a flat tree (BUNSHIN_TREE=flat)
    every process of a child workspace is a child of the child's init, so getppid() is 1 and
    a shell's `wait` does not see its old background jobs (they still run and can be
    signalled)."""
    from bunshin._core import backend
    from bunshin.fork.cloners import cloner

    exact = backend().reparent is not None or cloner().exact_tree()
    ws = bunshin.Workspace.create()
    family.append(ws)
    sh = ws.shell()
    sh.run("sleep 1000 & sleep 1001 &")
    ws.run("sh -c 'sleep 1002 & exec sleep 1003' >/dev/null 2>&1 &")  # a tree not under a shell
    bash = sh.pid
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        procs = ws.processes()
        if {"1002", "1003"} <= {p.cmdline[-1] for p in procs if p.cmdline}:
            break
        time.sleep(0.02)
    before = {p.pid: p.ppid for p in procs}
    assert sum(1 for pid, ppid in before.items() if ppid == bash) == 2
    kids = ws.fork(2)
    family.extend(kids)
    for w in (ws, *kids):
        after = {p.pid: p.ppid for p in w.processes()}
        assert after.keys() == before.keys()
        if exact or w is ws:  # the source keeps its own processes
            assert after == before, w
        else:
            assert all(ppid == 1 for pid, ppid in after.items() if pid != 1), w
    kid = kids[0]
    s = kid.shells[0]
    jobs = [int(x) for x in s.run("jobs -p").stdout.split()]
    assert all(int(ws_status(kid, j, "PPid")) == (bash if exact else 1) for j in jobs)
    if backend().join_session is not None:  # in the shell's session, each job its own group
        assert all((ws_status(kid, j, "NSsid"), ws_status(kid, j, "NSpgid")) == (str(bash), str(j))
                   for j in jobs), [(ws_status(kid, j, "NSsid"), ws_status(kid, j, "NSpgid")) for j in jobs]
    # one command line: no prompt in between at which bash would report and forget the job
    r = s.run("kill %1; wait %1; echo rc=$?", timeout=10)
    assert not r.timed_out
    if exact:
        assert r.stdout.endswith(b"rc=143\n"), r  # bash reaps its own job, killed by SIGTERM
    else:
        assert not r.stdout.endswith(b"rc=143\n"), r  # bash cannot wait for a job it did not fork


def test_forks_of_one_template_stay_at_one_depth(family):
    """Each ws.fork() moves the workspace one pid namespace deeper; forks of one template, and
    rollbacks onto it, do not."""
    ws = bunshin.Workspace.create()
    family.append(ws)
    tpl = ws.snapshot()
    try:
        depths = set()
        for _ in range(3):
            ws.restore(tpl)
            depths.add(_pid_ns_level(ws))
        assert len(depths) == 1
    finally:
        tpl.close()


def _pid_ns_level(ws) -> int:
    return len(proc_status(ws.init_pid)["NSpid"].split()) - 1  # the host's view: every level


def test_nesting_limit_is_a_clear_error_without_rebase(family, monkeypatch):
    monkeypatch.setenv("BUNSHIN_REBASE", "0")
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.shell().run("V=deep")
    with pytest.raises(ForkError, match="pid namespaces deep"):
        for _ in range(40):
            ws.adopt(ws.fork(1)[0])  # the workspace becomes its fork: one level deeper
    assert _pid_ns_level(ws) == 32
    assert ws.shells[0].run("echo $V").stdout == b"deep\n"


def test_a_workspace_at_the_nesting_limit_goes_back_to_the_top_and_forks_on(family):
    """At the kernel's 32 levels the next ws.fork() first moves the workspace back to the top
    level (CRIU dump and restore into the same object): 40 forks in a row, each adopted (a
    speculation's commit), work, and the shell,
    a Python process's memory and the files are still the workspace's."""
    _need_criu()
    ws = bunshin.Workspace.create()
    family.append(ws)
    sh = ws.shell()
    sh.run("cd /tmp; V=deep; echo kept > f")
    py = ws.spawn(["python3", "-c", "import time\nx = 'x' * (8 << 20)\n"
                   "open('/tmp/x.len', 'w').write(str(len(x)))\nwhile True: time.sleep(0.05)"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ws.run("test -s /tmp/x.len").exit_code:
        time.sleep(0.02)
    levels = []
    for _ in range(40):
        (kid,) = ws.fork(1)
        assert kid.shells[0].run("echo $V").stdout == b"deep\n"
        ws.adopt(kid)  # the workspace becomes its fork: one level deeper
        levels.append(_pid_ns_level(ws))
    assert max(levels) == 32 and levels[-1] < 32  # it reached the limit, then went back up
    assert sh.run("echo $V $PWD; cat f").stdout == b"deep /tmp\nkept\n"
    assert py in [p.pid for p in ws.processes()]
    assert ws.read_file("/tmp/x.len") == b"8388608"
    assert ws.run(f"kill -0 {py} && echo alive").stdout == b"alive\n"


def test_a_workspace_criu_cannot_move_back_to_the_top_says_why_and_runs_on(family, monkeypatch):
    """In a flat tree a shell job started before a fork keeps the template's session in its
    clone, which CRIU refuses to dump: at the limit the fork says so (checked without trying
    CRIU), and the workspace runs on as it was."""
    _need_criu()
    monkeypatch.setenv("BUNSHIN_TREE", "flat")
    ws = bunshin.Workspace.create()
    family.append(ws)
    sh = ws.shell()
    sh.run("V=deep; sleep 1000 &")
    with pytest.raises(ForkError, match=r"limit of 32 nested pid namespaces and cannot be moved back "
                                        r"to the top level through CRIU: process \d+ \(sleep\) is in "
                                        r"a session whose leader is outside the workspace"):
        for _ in range(40):
            ws.adopt(ws.fork(1)[0])  # the workspace becomes its fork: one level deeper
    assert _pid_ns_level(ws) == 32
    assert sh.run("echo $V; jobs").stdout.decode().split("\n")[0] == "deep"
    assert b"sleep 1000" in sh.run("jobs").stdout


def _need_criu() -> None:
    from bunshin.criu import runner
    from bunshin.errors import CriuError

    try:
        runner.criu()
    except CriuError as e:
        pytest.skip(f"no usable CRIU: {e}")


def test_restore_from_another_workspaces_template(family):
    """A workspace can roll onto any template; its shell object then speaks to the template's
    session (same pid, another session's marker)."""
    a, b = bunshin.Workspace.create(), bunshin.Workspace.create()
    family.extend([a, b])
    a.shell().run("WHO=a")
    sh_b = b.shell()
    sh_b.run("WHO=b")
    tpl = a.snapshot()
    try:
        b.restore(tpl)
        assert sh_b.run("echo $WHO").stdout == b"a\n"
    finally:
        tpl.close()


def _zombie_children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    st = f.read()
            except OSError:
                continue
            fields = st[st.rindex(b")") + 2:].split()
            if int(fields[1]) == pid and fields[0] == b"Z":
                out.append(int(d))
    return out


def _no_zombie_in_template_and_child_alive(tpl, kid) -> None:
    for pid in tpl.host_pids():
        assert _zombie_children(pid) == [], pid
    assert kid.run("echo alive").stdout == b"alive\n"


def _ignores_sigchld(pid: int) -> bool:
    return bool(int(proc_status(pid)["SigIgn"], 16) & (1 << (signal.SIGCHLD - 1)))


def test_the_kernel_reaps_the_inits_of_closed_children(ws):
    """A child's init is a child of the frozen template's init, which never runs its own code
    again: from the first fork on it ignores SIGCHLD, so the kernel reaps each closed child's
    init (and each intermediate made as its grandchild's sibling) as it dies. The child's
    init, cloned from it, reads its own children's deaths again."""
    ws.spawn(["sleep", "1000"])
    assert not _ignores_sigchld(ws.init_pid)
    tpl = ws.snapshot()
    assert not _ignores_sigchld(ws.init_pid)  # the source's init runs on: it reaps its own
    kids: list[bunshin.Workspace] = []
    try:
        tinit = tpl._core.body.init_pid
        kids += tpl.fork(3)
        assert _ignores_sigchld(tinit)
        for k in kids:
            assert not _ignores_sigchld(k.init_pid)
            r = k.run("sh -c 'exit 7'")  # the child's init still sees its children's status
            assert r.exit_code == 7
        while kids:
            kids.pop().close()
        assert _zombie_children(tinit) == []
        kids += tpl.fork(2)
        _no_zombie_in_template_and_child_alive(tpl, kids[0])
    finally:
        for k in kids:
            k.close()
        tpl.close()


def test_template_reaps_the_inits_of_closed_children_where_its_init_would_not_ignore_them(ws, monkeypatch):
    """Where the template's init cannot be made to ignore SIGCHLD, each closed child's init
    stays its zombie: a fork reaps them, inside the template, once REAP_AT children have
    closed since the last reap (and not before). The intermediates a clone goes through are
    reaped by their template process at once."""
    from bunshin.fork import seize
    from bunshin.fork.template import REAP_AT

    monkeypatch.setattr(seize, "ignore_children", lambda init: False)
    ws.spawn(["sleep", "1000"])
    tpl = ws.snapshot()
    kids: list[bunshin.Workspace] = []
    try:
        tinit = tpl._core.body.init_pid
        assert not _ignores_sigchld(tinit)
        for k in tpl.fork(REAP_AT - 1):
            k.close()
        assert len(_zombie_children(tinit)) == REAP_AT - 1
        kids += tpl.fork(1)  # too few closed: left for later
        assert len(_zombie_children(tinit)) == REAP_AT - 1
        kids.pop().close()
        kids += tpl.fork(1)  # REAP_AT closed: all reaped, in one stop of the template's init
        assert _zombie_children(tinit) == []
        assert len(tpl.host_pids()) == 2
        _no_zombie_in_template_and_child_alive(tpl, kids[0])
    finally:
        for k in kids:
            k.close()
        tpl.close()


_CLOEXEC_FDS = r"""
import ctypes, fcntl, os, signal
libc = ctypes.CDLL(None, use_errno=True)
def plain_open(path):  # os.open always adds O_CLOEXEC
    return libc.open(path.encode(), os.O_RDWR | os.O_CREAT, 0o644)
a = plain_open("/tmp/a")                                        # none
b = os.open("/tmp/b", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)   # set at open
c = os.open("/tmp/c", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
os.dup2(c, 20, inheritable=True)                                # the file says O_CLOEXEC, 20 has none
d = os.open("/tmp/d", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
os.set_inheritable(d, True)                                     # cleared after open
e = plain_open("/tmp/e")
os.set_inheritable(e, False)                                    # set after open
m = os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY)
fcntl.ioctl(m, 0x40045431, bytes(4))                           # TIOCSPTLCK: unlock
f = fcntl.ioctl(m, 0x5441, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)  # TIOCGPTPEER: the file keeps
os.set_inheritable(f, True)                                     # O_CLOEXEC, the descriptor has none
fds = [a, b, c, 20, d, e, f]
def report(*_):
    flags = [fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC for fd in fds]
    with open("/tmp/cloexec.new", "w") as f:
        f.write(" ".join(map(str, flags)))
    os.rename("/tmp/cloexec.new", "/tmp/cloexec")
signal.signal(signal.SIGUSR1, report)
report()
while True:
    signal.pause()
"""


def test_close_on_exec_flags_survive_every_fork(ws):
    """Each descriptor keeps its own FD_CLOEXEC, also where /proc's fdinfo cannot tell (a pty
    peer opened with O_CLOEXEC whose descriptor dropped it shows O_CLOEXEC), on the first
    fork of a template and on later ones."""
    ws.write_file("/fds.py", _CLOEXEC_FDS)
    pid = ws.spawn(["python3", "/fds.py"])
    wait_file(ws, "/tmp/cloexec")
    want = ws.read_file("/tmp/cloexec")
    assert want == b"0 1 1 0 0 1 0"
    tpl = ws.snapshot()
    try:
        for _ in range(2):
            (kid,) = tpl.fork(1)
            try:
                assert signal_and_read(kid, pid, 10, "/tmp/cloexec") == want
            finally:
                kid.close()
    finally:
        tpl.close()


_MANY_CLOEXEC_FDS = r"""
import fcntl, os, signal
# eventfds keep EFD_CLOEXEC in their file's flags, so fdinfo shows O_CLOEXEC on every one
# whatever its descriptor has: the fork must ask each, more than one batch of calls can take
fds = [os.eventfd(i, os.EFD_CLOEXEC) for i in range(60)]
for fd in fds[::3]:
    os.set_inheritable(fd, True)
def report(*_):
    flags = [fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC for fd in fds]
    counts = [os.eventfd_read(fd) for fd in fds[1:4]]
    for fd, n in zip(fds[1:4], counts):
        os.eventfd_write(fd, n)
    with open("/tmp/cloexec.new", "w") as f:
        f.write(" ".join(map(str, flags + counts)))
    os.rename("/tmp/cloexec.new", "/tmp/cloexec")
signal.signal(signal.SIGUSR1, report)
report()
while True:
    signal.pause()
"""


@pytest.mark.parametrize("path", ["ws_fork", "tpl_fork"])
def test_close_on_exec_flags_of_many_descriptors_fdinfo_cannot_tell(ws, path):
    """Sixty descriptors whose FD_CLOEXEC /proc's fdinfo cannot tell (more than one batch of
    the calls that read them in the template takes) keep theirs in the child, and in the
    source, which runs on after the fork."""
    ws.write_file("/fds.py", _MANY_CLOEXEC_FDS)
    pid = ws.spawn(["python3", "/fds.py"])
    wait_file(ws, "/tmp/cloexec")
    want = ws.read_file("/tmp/cloexec")
    assert want.split()[:6] == [b"0", b"1", b"1", b"0", b"1", b"1"] and want.split()[60:] == [b"1", b"2", b"3"]
    kid = fork_by(ws, path)
    try:
        assert signal_and_read(kid, pid, 10, "/tmp/cloexec") == want
        assert signal_and_read(ws, pid, 10, "/tmp/cloexec") == want
    finally:
        kid.close()


_PAUSER = r"""
import signal
woke = 0
def on_usr2(sig, frame):
    global woke
    woke += 1
    open(f"/tmp/woke-{woke}", "w").close()
signal.signal(signal.SIGUSR2, on_usr2)
open("/tmp/ready", "w").close()
while True:
    signal.pause()
"""


def test_a_signal_sent_as_the_fork_ends_interrupts_the_call_the_process_sleeps_in(ws):
    """A process frozen inside pause() is cloned inside it. A signal that reaches the clone
    before it runs again (here: sent from on_fork, before the clones resume) must interrupt
    that pause() (its handler runs, pause returns EINTR), not run the handler and then let
    the clone enter pause() again and sleep on: the kernel, not the engine, restarts an
    interrupted call as the clone leaves its last ptrace stop."""
    import signal

    pid = ws.spawn(["python3", "-c", _PAUSER])
    wait_file(ws, "/tmp/ready")
    tpl = ws.snapshot()
    try:
        for _ in range(2):
            (kid,) = tpl.fork(1, on_fork=lambda k: k.kill(pid, signal.SIGUSR2))
            try:
                wait_file(kid, "/tmp/woke-1", timeout=5)
                kid.kill(pid, signal.SIGUSR2)  # and it goes on taking signals
                wait_file(kid, "/tmp/woke-2", timeout=5)
            finally:
                kid.close()
    finally:
        tpl.close()


def _robust_list(tid: int) -> tuple[int, int]:
    """(head, len) of a thread's robust futex list (get_robust_list)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    head, n = ctypes.c_void_p(), ctypes.c_size_t()
    if libc.syscall(274, tid, ctypes.byref(head), ctypes.byref(n)):
        raise OSError(ctypes.get_errno(), f"get_robust_list({tid})")
    return head.value or 0, n.value


def test_each_clone_has_its_template_processs_robust_list(ws):
    """fork(2) drops the child's robust futex list; glibc registered one for every thread, so
    each clone gets its template process's back (a lock held by a thread that dies would
    otherwise never be released to its waiters)."""
    ws.shell().run("true")
    ws.spawn(["python3", "-c", "import time\nwhile True: time.sleep(0.05)"])
    time.sleep(0.3)
    tpl = ws.snapshot()
    try:
        for _ in range(2):  # the first fork's intermediates are its own, the second's made ahead
            (kid,) = tpl.fork(1)
            try:
                by_vpid = {pl.vpid: pl.hostpid for pl in tpl._core.plans}
                kids = {int(proc_status(hp)["NSpid"].split()[-1]): hp for hp in kid.host_pids()}
                assert sorted(kids) == sorted(by_vpid)
                for vpid, hostpid in by_vpid.items():
                    want = _robust_list(hostpid)
                    assert want[0], (vpid, want)  # glibc gave it one
                    assert _robust_list(kids[vpid]) == want, vpid
            finally:
                kid.close()
    finally:
        tpl.close()


# Root with other gids and supplementary groups (it keeps its capabilities), SIGUSR1 caught,
# SIGUSR2 ignored; it leaves a file once all is set.
_CREDS = r"""
import os, signal, time
os.setgroups([5, 6]); os.setresgid(1001, 1002, 1003)
signal.signal(signal.SIGUSR1, lambda *a: None); signal.signal(signal.SIGUSR2, signal.SIG_IGN)
open("/tmp/creds.ready", "w").close()
while True:
    time.sleep(0.05)
"""


def test_credentials_handlers_environment_and_cgroup_are_kept(family):
    """What fork() copies anyway, checked on a real clone: ids and groups, capabilities,
    signal dispositions, environment, root and cwd; and each child's processes are in the
    child's own cgroup, not the source's."""
    ws = bunshin.Workspace.create()
    family.append(ws)
    pid = ws.spawn(["python3", "-c", _CREDS], env={"BUNSHIN_TEST_VAR": "forty-two"}, cwd="/tmp")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ws.run("test -e /tmp/creds.ready").exit_code:
        time.sleep(0.02)
    keys = ("Uid", "Gid", "Groups", "CapEff", "CapPrm", "CapBnd", "SigCgt", "SigIgn", "SigBlk", "Umask")
    want = {k: ws_status(ws, pid, k) for k in keys}
    assert want["Gid"].split() == ["1001", "1002", "1003", "1002"]  # real, effective, saved, fs
    assert want["Groups"] == "5 6"
    environ = ws.read_file(f"/proc/{pid}/environ")
    assert b"BUNSHIN_TEST_VAR=forty-two\0" in environ
    (kid,) = ws.fork(1)
    family.append(kid)
    for w in (ws, kid):
        assert {k: ws_status(w, pid, k) for k in keys} == want
        assert w.read_file(f"/proc/{pid}/environ") == environ
        assert w.run(f"readlink /proc/{pid}/cwd /proc/{pid}/root").stdout == b"/tmp\n/\n"
    mine, theirs = set(kid.host_pids()), set(ws.host_pids())
    assert mine and not mine & theirs
    assert mine <= set(kid.cgroup.pids()) and not mine & set(ws.cgroup.pids())
