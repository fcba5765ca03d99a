"""Forks carry ptys: a shell session's (master in the trainer) and one whose master is inside
the workspace, with the slave's owner and mode, termios, window size, packet mode, lock,
controlling terminal, session and foreground group; what a child could not have as the
template had it is refused by name. Each program checks its own terminal, in the child and
in the source, after ws.fork() and after snapshot() + tpl.fork()."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from conftest import SCRIPT_PRELUDE, fork_one, put, start_script
from conftest import wait_file as _wait

import bunshin
from bunshin._core.kmod import backend
from bunshin.errors import ForkError
from bunshin.fork.cloners import cloner


@pytest.fixture(params=["ws.fork", "tpl.fork", "slot"])
def fork(request, family, monkeypatch):
    """Fork a workspace one way or another ("slot": a template's second child, whose init and
    shell ptys' masters were made ahead); the child (and template) close with ``family``."""
    monkeypatch.setenv("BUNSHIN_FORK_SLOTS", "1")

    def make(ws):
        if request.param == "ws.fork":
            (kid,) = ws.fork(1)
        else:
            tpl = ws.snapshot()
            family.append(tpl)
            if request.param == "slot":
                family.extend(tpl.fork(1))
                _wait_slot(tpl._core)
            (kid,) = tpl.fork(1)
        family.append(kid)
        return kid
    return make


def _wait_slot(core, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with core.lock:
            if any(s.early is not None and s.early.chan.ready and s.early.meta is not None for s in core.slots):
                return
        time.sleep(0.01)
    raise AssertionError("no slot with an init made ahead")


# bash reads its own stat (a builtin: while a command runs, the foreground group is its)
SHELL_TTY = "stat -c '%u %g %a' $(tty); stty -g; stty size; read -r l < /proc/$$/stat; set -- ${l##*) }; " \
            "echo $4 $6; echo $$; python3 -c \"import os; os.open('/dev/tty', os.O_RDWR); print('devtty')\""


def test_shell_terminal_keeps_owner_mode_termios_size_and_session(family, fork):
    ws = bunshin.Workspace.create()
    family.append(ws)
    sh = ws.shell()
    sh.run("chown 1000:5 $(tty) && chmod 620 $(tty) && stty cols 123 rows 45 intr ^X -icrnl")
    before = sh.run(SHELL_TTY).stdout.decode().split("\n")
    owner, termios_, size, (sid, fg), pid, devtty = before[0], before[1], before[2], before[3].split(), before[4], before[5]
    assert (owner, size, sid, fg, devtty) == ("1000 5 620", "45 123", pid, pid, "devtty")
    kid = fork(ws)
    for w in (kid, ws):
        assert w.shells[0].run(SHELL_TTY).stdout.decode().split("\n") == before


JOB = """
import fcntl, os, signal, struct, termios
def report(*_):
    st = open('/proc/self/stat').read().rsplit(')', 1)[1].split()
    try:
        fd = os.open('/dev/tty', os.O_RDWR | os.O_NOCTTY)
        tty = [os.ttyname(fd), os.tcgetpgrp(fd), struct.unpack('i', fcntl.ioctl(fd, 0x5429, bytes(4)))[0]]
        os.close(fd)
    except OSError as e:
        tty = e.errno
    out('/tmp/report', json.dumps([int(st[4]), os.getsid(0), tty]))
signal.signal(signal.SIGUSR1, report)
out('/tmp/ready', str(os.getpid()))
while True:
    signal.pause()
"""


def test_shell_job_never_reaches_the_templates_terminal(family, fork):
    """A shell's background job is not a session leader: the module's JOIN_SESSION gives its
    clone the child's terminal, and so does the shell's clone that makes it (fork/tree.py); in
    a flat tree the clone keeps the template's session (outside the child) and has no terminal,
    rather than the template's pty, which every child would share."""
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.write_file("/t.py", SCRIPT_PRELUDE + JOB)
    sh = ws.shell()
    sh.run("python3 /t.py &")
    job = int(_wait(ws, "/tmp/ready"))
    shell_pid = sh.pid
    tty_nr, sid, tty = _report(ws, job)
    assert (sid, tty[1:]) == (shell_pid, [shell_pid, shell_pid]) and tty_nr != 0
    kid = fork(ws)
    joined = "user space" not in backend().uses["fork sessions"] or cloner().exact_tree()
    for w in (kid, ws):
        if joined or w is ws:  # the source keeps its own
            assert _report(w, job) == [tty_nr, sid, tty]
        else:
            assert _report(w, job) == [0, 0, 6]  # ENXIO: no controlling terminal
        assert w.shells[0].run("echo ok").stdout == b"ok\n"


def _report(w, pid: int) -> list:
    w.run("rm -f /tmp/report")
    w.kill(pid, signal.SIGUSR1)
    return json.loads(_wait(w, "/tmp/report"))


INNER = """
import fcntl, pty, signal, struct, termios, tty
master, slave = pty.openpty()
name = os.ttyname(slave)
os.fchown(slave, 1000, 5)
os.fchmod(slave, 0o600)
fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack('HHHH', 33, 77, 0, 0))
tty.setraw(slave)
fcntl.ioctl(master, termios.TIOCPKT, struct.pack('i', 1))
os.close(slave)
pid = os.fork()
if pid == 0:   # the session leader on the slave, opened by path: echoes what it reads
    os.close(master)
    os.setsid()
    fd = os.open(name, os.O_RDWR)          # fd 3, its controlling terminal (no O_NOCTTY)
    tty_ = os.open('/dev/tty', os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)   # fd 4, kept
    def state(*_):
        st = os.fstat(fd)
        out('/tmp/leader', json.dumps([st.st_uid, st.st_gid, st.st_mode & 0o777, termios.tcgetattr(fd)[3] & termios.ECHO,
                                       list(struct.unpack('HHHH', fcntl.ioctl(fd, termios.TIOCGWINSZ, bytes(8))))[:2],
                                       os.tcgetpgrp(tty_), os.getpid(), fcntl.fcntl(tty_, fcntl.F_GETFL) & os.O_NONBLOCK]))
    signal.signal(signal.SIGUSR2, state)
    while True:
        data = os.read(fd, 100)
        os.write(fd, data.upper())
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
out('/tmp/ready', f'{pid} {name}')
while True:
    signal.sigwait({signal.SIGUSR1})
    os.write(master, open('/tmp/word').read().encode())
    got = os.read(master, 100)   # packet mode: a status byte (0: data) before the bytes
    sid = struct.unpack('i', fcntl.ioctl(master, 0x5429, bytes(4)))[0]
    pgrp = struct.unpack('i', fcntl.ioctl(master, termios.TIOCGPGRP, bytes(4)))[0]
    out('/tmp/reply', json.dumps([got.hex(), sid, pgrp]))
"""


def test_pty_with_its_master_inside_keeps_its_state(family, fork):
    ws = start_script(family, INNER, "/tmp/ready")
    leader, name = ws.read_file("/tmp/ready").decode().split()
    leader = int(leader)
    driver = next(p.pid for p in ws.processes() if p.cmdline[:1] == ["python3"] and p.ppid == 1)
    kid = fork(ws)
    for w, word in ((kid, "forked"), (ws, "source")):
        w.run("rm -f /tmp/leader")
        w.kill(leader, signal.SIGUSR2)
        assert json.loads(_wait(w, "/tmp/leader")) == [1000, 5, 0o600, 0, [33, 77], leader, leader, os.O_NONBLOCK]
        put(w, "/tmp/word", word)
        w.kill(driver, signal.SIGUSR1)
        assert json.loads(_wait(w, "/tmp/reply")) == [(b"\0" + word.upper().encode()).hex(), leader, leader]
        links = w.run(f"readlink /proc/{leader}/fd/3 /proc/{leader}/fd/4").stdout.decode().split()
        assert links == [name, "/dev/tty"]


def test_locked_pty_stays_locked(family, fork):
    ws = start_script(family, """
import fcntl, signal, struct, termios
master = os.open('/dev/ptmx', os.O_RDWR | os.O_NOCTTY)    # never unlocked
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
out('/tmp/ready', '')
while True:
    signal.sigwait({signal.SIGUSR1})
    n = struct.unpack('I', fcntl.ioctl(master, 0x80045430, bytes(4)))[0]
    locked = struct.unpack('i', fcntl.ioctl(master, 0x80045439, bytes(4)))[0]   # TIOCGPTLCK
    try:
        os.close(os.open(f'/dev/pts/{n}', os.O_RDWR | os.O_NOCTTY)); opened = 'opened'
    except OSError as e:
        opened = e.errno
    out('/tmp/out', json.dumps([n, locked, opened]))
""", "/tmp/ready")
    pid = next(p.pid for p in ws.processes() if p.cmdline[:1] == ["python3"])
    kid = fork(ws)
    for w in (kid, ws):
        w.kill(pid, signal.SIGUSR1)
        assert json.loads(_wait(w, "/tmp/out")) == [0, 1, 5]  # EIO: a locked pty's slave


@pytest.mark.parametrize("tree", ["exact", "flat"])
def test_foreground_group_other_than_the_leaders(family, monkeypatch, tree):
    """Carried in an exact tree (fork/tree.py: the job's clone is in its leader's clone's
    session), refused in a flat one (the job's clone would be outside it)."""
    monkeypatch.setenv("BUNSHIN_TREE", tree)
    ws = start_script(family, """
import pty, signal
pid, master = pty.fork()
if pid == 0:   # the session leader hands its terminal to a job in a group of its own
    job = os.fork()
    if job == 0:
        os.setpgid(0, 0)
        time.sleep(1000)
    os.setpgid(job, job)
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    os.tcsetpgrp(0, job)
    out('/tmp/ready', str(job))
    time.sleep(1000)
time.sleep(1000)
""", "/tmp/ready")
    job = ws.read_file("/tmp/ready").decode()
    if tree == "exact" and cloner().exact_tree():
        (kid,) = ws.fork(1)
        family.append(kid)
        for w in (kid, ws):
            assert w.run(f"ps -o tpgid=,pgid= -p {job}").stdout.split() == [job.encode()] * 2
        return
    with pytest.raises(ForkError, match=rf"process \d+ \(python3\): its controlling terminal /dev/pts/0 has "
                                        rf"group {job} as its foreground process group"):
        ws.fork(1)


def test_slave_open_on_a_relocked_pty_is_refused(family):
    ws = start_script(family, """
import fcntl, pty, struct
master, slave = pty.openpty()
fcntl.ioctl(master, 0x40045431, struct.pack('i', 1))   # TIOCSPTLCK: locked again
out('/tmp/ready', str(slave))
time.sleep(1000)
""", "/tmp/ready")
    slave = ws.read_file("/tmp/ready").decode()
    with pytest.raises(ForkError, match=rf"process \d+ \(python3\) fd {slave}: pty /dev/pts/0 was locked again"):
        ws.fork(1)


@pytest.mark.parametrize("size", [8, 6000])  # 6000: more than the ldisc's buffer holds
def test_output_the_master_inside_has_not_read_is_kept(family, fork, size):
    """Bytes the slave's program wrote (after its output processing: "\\n" became "\\r\\n")
    and the driver had not read yet: the driver reads them in the child and in the source."""
    ws = start_script(family, f"""
import pty, signal
pid, master = pty.fork()
if pid == 0:
    os.write(1, b'p' * {size - 1} + b'\\n')
    out('/tmp/ready', '')
    time.sleep(1000)
signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGUSR1}})
signal.sigwait({{signal.SIGUSR1}})
got = b''
while not got.endswith(b'\\n'):
    got += os.read(master, 65536)
out('/tmp/got', got.hex())
time.sleep(1000)
""", "/tmp/ready")
    driver = next(p.pid for p in ws.processes() if p.cmdline[:1] == ["python3"] and p.ppid == 1)
    kid = fork(ws)
    for w in (kid, ws):
        w.kill(driver, signal.SIGUSR1)
        assert bytes.fromhex(_wait(w, "/tmp/got")) == b"p" * (size - 1) + b"\r\n"


def test_input_the_raw_slave_has_not_read_is_kept(family, fork):
    """Bytes the driver wrote and the program on the raw slave had not read: it reads them,
    unprocessed (no echo, "\\r" not made "\\n"), in the child and in the source."""
    ws = start_script(family, """
import pty, signal, tty
pid, master = pty.fork()
if pid == 0:
    tty.setraw(0)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    out('/tmp/raw', '')
    signal.sigwait({signal.SIGUSR1})
    out('/tmp/got', os.read(0, 100).hex())
    time.sleep(1000)
wait('/tmp/raw')
os.write(master, b'typed\\r\\x03')
out('/tmp/ready', str(pid))
time.sleep(1000)
""", "/tmp/ready")
    reader = int(ws.read_file("/tmp/ready").decode())
    kid = fork(ws)
    for w in (kid, ws):
        w.kill(reader, signal.SIGUSR1)
        assert bytes.fromhex(_wait(w, "/tmp/got")) == b"typed\r\x03"


def test_input_a_canonical_reader_has_not_read_is_kept_line_by_line(family, fork):
    """Lines the driver typed towards a program reading in canonical mode (echo on), ended by
    a return and by EOF, and a line still being typed (with an erase): in the child and in the
    source the program reads the same lines, one a read, the driver finishes the line, and
    nothing typed before the fork is echoed again."""
    ws = start_script(family, """
import pty, signal
pid, master = pty.fork()
if pid == 0:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    out('/tmp/canon', '')
    signal.sigwait({signal.SIGUSR1})
    out('/tmp/got', json.dumps([os.read(0, 100).hex() for _ in range(3)]))
    time.sleep(1000)
wait('/tmp/canon')
os.write(master, b'ls -l\\r' + b'echo hi\\x04' + b'parx\\x7f')
time.sleep(0.1)
out('/tmp/ready', str(pid))
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
signal.sigwait({signal.SIGUSR2})
echoed = os.read(master, 1000)
os.write(master, b'tial\\r')
out('/tmp/echo', echoed.hex())
time.sleep(1000)
""", "/tmp/ready")
    reader = int(ws.read_file("/tmp/ready").decode())
    driver = next(p.pid for p in ws.processes() if p.cmdline[:1] == ["python3"] and p.ppid == 1)
    kid = fork(ws)
    echoes = []
    for w in (kid, ws):
        w.kill(reader, signal.SIGUSR1)
        time.sleep(0.1)
        w.kill(driver, signal.SIGUSR2)
        got = [bytes.fromhex(line) for line in json.loads(_wait(w, "/tmp/got"))]
        assert got == [b"ls -l\n", b"echo hi", b"partial\n"]
        echoes.append(bytes.fromhex(_wait(w, "/tmp/echo")))
    assert echoes[0] == echoes[1] and echoes[0].startswith(b"ls -l\r\necho hi") and echoes[0].count(b"ls") == 1


def test_output_stopped_by_ctrl_s_stays_stopped_in_the_source(family):
    """The driver typed ^S (IXON: the program's output stops) and half a line: carrying that
    line leaves the source's output stopped (IXON is never turned off, which would restart
    it). The child's pty is not stopped: a deviation (a ^S typed earlier is not carried)."""
    ws = start_script(family, """
import pty, signal
pid, master = pty.fork()
if pid == 0:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    out('/tmp/canon', '')
    signal.sigwait({signal.SIGUSR1})
    os.set_blocking(1, False)
    try:
        os.write(1, b'x')
        out('/tmp/stopped', 'no')
    except BlockingIOError:
        out('/tmp/stopped', 'yes')
    time.sleep(1000)
wait('/tmp/canon')
os.write(master, b'\\x13half')
time.sleep(0.1)
out('/tmp/ready', str(pid))
time.sleep(1000)
""", "/tmp/ready")
    reader = int(ws.read_file("/tmp/ready").decode())
    fork_one(family, ws)
    ws.kill(reader, signal.SIGUSR1)
    assert _wait(ws, "/tmp/stopped") == "yes"


# A shell's background job holding /dev/tty, which tells, on SIGUSR1, what that descriptor is.
HELD_TTY = SCRIPT_PRELUDE + """
import fcntl, signal
fd = os.open('/dev/tty', os.O_RDWR)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
out('/tmp/ready', json.dumps([fd, os.getpid()]))
while True:
    signal.sigwait({signal.SIGUSR1})
    st = open('/proc/self/stat').read()
    tty_nr = int(st[st.rindex(')') + 2:].split()[4])
    dev = struct.unpack('I', fcntl.ioctl(fd, 0x80045432, bytes(4)))[0]  # TIOCGDEV
    sid = struct.unpack('i', fcntl.ioctl(fd, 0x5429, bytes(4)))[0]  # TIOCGSID
    out('/tmp/held', json.dumps([os.readlink(f'/proc/self/fd/{fd}'), dev == tty_nr != 0, sid == os.getsid(0)]))
"""


def test_dev_tty_held_by_a_shell_job(family, fork):
    """A job's /dev/tty descriptor is its shell's terminal: in an exact tree its clone is made
    by its shell's clone, in its session, and has the child's terminal there; elsewhere its
    clone keeps the template's session, which cannot have the child's terminal: refused."""
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.write_file("/t.py", HELD_TTY)
    ws.shell().run("python3 /t.py &")
    fd, pid = json.loads(_wait(ws, "/tmp/ready"))
    if not cloner().exact_tree():
        with pytest.raises(ForkError, match=rf"process \d+ \(python3\) fd {fd}: /dev/tty of a process that "
                                            "is not its session leader"):
            fork(ws)
        return
    kid = fork(ws)
    for w in (kid, ws):
        w.run("rm -f /tmp/held")
        w.kill(pid, signal.SIGUSR1)
        assert json.loads(_wait(w, "/tmp/held")) == ["/dev/tty", True, True]
