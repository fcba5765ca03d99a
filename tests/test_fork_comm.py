"""Forks carry communication state: eventfd, timerfd, unix sockets (pairs with queued bytes,
listeners on paths and abstract names), epoll — proven with python3 programs in workspaces,
each side driven independently after the fork."""

from __future__ import annotations

import os
import signal

import pytest
from conftest import SCRIPT_PRELUDE, fork_one, put, start_script
from conftest import wait_file as _wait

import bunshin
from bunshin.errors import ForkError
from bunshin.fork.resources import eventfd, sharing

EVENTFD = """
e = os.eventfd(7, os.EFD_NONBLOCK)
s = os.eventfd(3, os.EFD_SEMAPHORE)
if os.fork() == 0:  # a second process sharing both eventfds
    wait('/tmp/go'); os.eventfd_write(e, 100); out('/tmp/b-done', ''); time.sleep(1000)
out('/tmp/ready', '')
wait('/tmp/go'); wait('/tmp/b-done')
v = os.eventfd_read(e)
try:
    os.eventfd_read(e); nb = 'blocking'
except BlockingIOError:
    nb = 'nonblock'
out('/tmp/out', f'{v} {nb} {[os.eventfd_read(s) for _ in range(3)]}')
time.sleep(1000)
"""


@pytest.fixture(params=["fdinfo", "asked"])
def semaphore_from(request, monkeypatch):
    """How the fork learns EFD_SEMAPHORE: fdinfo (Linux >= 6.6), or, as on older kernels whose
    fdinfo lacks the line, by asking the eventfd."""
    if request.param == "asked":
        real = sharing.fdinfo

        def old_kernel(hostpid, fd):
            info = real(hostpid, fd)
            info.pop("eventfd-semaphore", None)
            return info

        monkeypatch.setattr(eventfd.sharing, "fdinfo", old_kernel)
    return request.param


@pytest.mark.parametrize("sem", [False, True])
@pytest.mark.parametrize("count", [0, 1, 2, 5])
def test_semaphore_is_asked_of_the_eventfd_and_its_count_kept(sem, count):
    fd = os.eventfd(count, os.EFD_SEMAPHORE if sem else 0)
    try:
        assert eventfd.is_semaphore(os.getpid(), fd, count) is sem
        assert int(sharing.fdinfo(os.getpid(), fd)["eventfd-count"], 16) == count
    finally:
        os.close(fd)


def test_eventfd_keeps_count_flags_and_sharing(family, semaphore_from):
    ws = start_script(family, EVENTFD, "/tmp/ready")
    kid = fork_one(family, ws)
    # the kid goes first: had it kept the source's eventfd, the source would then read 0 (EAGAIN)
    for w in (kid, ws):
        put(w, "/tmp/go", "")
        # 7 carried + 100 written by the other process of the same workspace; still semaphore
        assert _wait(w, "/tmp/out") == "107 nonblock [1, 1, 1]"


TIMERFD = """
import ctypes, struct
libc = ctypes.CDLL(None, use_errno=True)
def tfd(clock, value, interval):
    fd = libc.timerfd_create(clock, 0)
    its = struct.pack('4q', int(interval), int(interval % 1 * 1e9), int(value), int(value % 1 * 1e9))
    assert libc.timerfd_settime(fd, 0, its, None) == 0
    return fd
def left(fd):
    buf = ctypes.create_string_buffer(32)
    libc.timerfd_gettime(fd, buf)
    i, ins, v, vns = struct.unpack('4q', buf.raw)
    return i + ins / 1e9, v + vns / 1e9
periodic = tfd(1, 0.2, 0.2)      # CLOCK_MONOTONIC, every 0.2 s, never read before the fork
expired = tfd(1, 0.01, 0)        # one-shot, expired, its tick unread
far = tfd(7, 1000, 0)            # CLOCK_BOOTTIME, 1000 s away
time.sleep(0.3)
out('/tmp/ready', f'{periodic} {expired} {far}')
wait('/tmp/go')
ticks = struct.unpack('Q', os.read(periodic, 8))[0]
again = struct.unpack('Q', os.read(periodic, 8))[0]  # blocks until the next expiry: still armed
unread = struct.unpack('Q', os.read(expired, 8))[0]
out('/tmp/out', repr((ticks, again, unread, left(periodic)[0], left(far))))
time.sleep(1000)
"""


def test_timerfd_is_rearmed_with_time_left_interval_and_ticks(family):
    ws = start_script(family, TIMERFD, "/tmp/ready")
    periodic, expired, far = map(int, ws.read_file("/tmp/ready").split())
    kid = fork_one(family, ws)
    info = kid.read_file(f"/proc/2/fdinfo/{far}").decode()
    assert "clockid: 7" in info
    for w in (kid, ws):
        put(w, "/tmp/go", "")
        ticks, again, unread, interval, (far_interval, far_left) = eval(_wait(w, "/tmp/out"))
        assert ticks >= 1 and again >= 1 and unread == 1
        assert abs(interval - 0.2) < 1e-6 and far_interval == 0
        assert 900 < far_left < 1000


FAST_TIMERFD = """
import ctypes, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.timerfd_create(1, 0)
assert libc.timerfd_settime(fd, 0, struct.pack('4q', 0, 20000, 0, 20000), None) == 0  # every 20 us
out('/tmp/ready', '')
wait('/tmp/go')
n = sum(struct.unpack('Q', os.read(fd, 8))[0] for _ in range(3))  # blocks if it is not armed
out('/tmp/out', str(n))
time.sleep(1000)
"""


def test_periodic_timerfd_due_again_while_the_fork_reads_it_stays_armed(family):
    # 20 us: the timer has fired again (frozen, nobody reads it) by the time the fork reads
    # the time it has left after moving it on, which is then 0
    ws = start_script(family, FAST_TIMERFD, "/tmp/ready")
    kid = fork_one(family, ws)
    for w in (kid, ws):
        put(w, "/tmp/go", "")
        assert int(_wait(w, "/tmp/out")) >= 3


PAIRS = """
import socket
TYPES = (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET)
pairs = [socket.socketpair(type=t) for t in TYPES]
role = 'b' if os.fork() == 0 else 'a'
mine = [p[0] if role == 'a' else p[1] for p in pairs]
for p in pairs:
    (p[1] if role == 'a' else p[0]).close()
for s in mine:  # queued, unread at fork time
    s.send(f'{role}1'.encode()); s.send(f'{role}2'.encode())
out(f'/tmp/{role}-sent', '')
wait('/tmp/go')
got = []
for s in mine:
    if s.type == socket.SOCK_STREAM:
        data = b''
        while len(data) < 4:
            data += s.recv(4 - len(data))
        got.append(data.decode())
    else:
        got.append(s.recv(100).decode() + '|' + s.recv(100).decode())
for s in mine:  # and the pair still talks both ways
    s.send(b'after-' + role.encode())
got += [s.recv(100).decode() for s in mine]
out(f'/tmp/{role}-out', repr(got))
time.sleep(1000)
"""


def test_socketpairs_keep_queued_bytes_and_talk_afterfork_one(family):
    ws = start_script(family, PAIRS, "/tmp/a-sent")
    _wait(ws, "/tmp/b-sent")
    pids = " ".join(f"/proc/{p.pid}/fd" for p in ws.processes() if "/t.py" in str(p.cmdline))
    fds = ws.run(f"ls {pids}").stdout
    assert fds.count(b"/fd:") == 2
    kid = fork_one(family, ws)
    assert kid.run(f"ls {pids}").stdout == fds  # the ends kept aside during the fork are closed
    for w in (kid, ws):
        put(w, "/tmp/go", "")
        assert eval(_wait(w, "/tmp/a-out")) == ["b1b2", "b1|b2", "b1|b2"] + ["after-b"] * 3
        assert eval(_wait(w, "/tmp/b-out")) == ["a1a2", "a1|a2", "a1|a2"] + ["after-a"] * 3


SERVER = """
import select, socket
ep = select.epoll()  # made first: a lower fd than everything it watches
ev = os.eventfd(0, os.EFD_NONBLOCK)
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind('/tmp/srv.sock'); os.chmod('/tmp/srv.sock', 0o600); srv.listen(7)
ab = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
ab.bind('\\0bunshin-abstract'); ab.listen(3)
for s in (srv, ab):
    ep.register(s, select.EPOLLIN)
ep.register(ev, select.EPOLLIN | select.EPOLLET)
n = 0
out('/tmp/ready', '')
while True:
    for fd, _ in ep.poll():
        if fd == ev:
            n += 1000 * os.eventfd_read(ev)
            continue
        c, _ = (srv if fd == srv.fileno() else ab).accept()
        n += 1
        c.send(str(n).encode()); c.close()
"""

CLIENT = ("python3 -c \"import socket, sys; s = socket.socket(socket.AF_UNIX, getattr(socket, sys.argv[1])); "
          "s.connect(sys.argv[2].replace('@', chr(0))); print(s.recv(10).decode())\"")


def _ask(w, kind: str, addr: str) -> str:
    r = w.run(f"{CLIENT} {kind} {addr}", timeout=20)
    assert r.exit_code == 0, r
    return r.stdout.decode().strip()


def test_listeners_on_path_and_abstract_name_and_epoll_keep_serving(family):
    ws = start_script(family, SERVER, "/tmp/ready")
    assert _ask(ws, "SOCK_STREAM", "/tmp/srv.sock") == "1"
    kid = fork_one(family, ws)
    assert kid.run("stat -c %a /tmp/srv.sock").stdout == b"600\n"
    # each side counts on from 1, alone: the server's memory and its listeners are its own
    assert _ask(kid, "SOCK_STREAM", "/tmp/srv.sock") == "2"
    assert _ask(kid, "SOCK_SEQPACKET", "@bunshin-abstract") == "3"
    assert _ask(ws, "SOCK_SEQPACKET", "@bunshin-abstract") == "2"
    assert _ask(kid, "SOCK_STREAM", "/tmp/srv.sock") == "4"
    assert _ask(ws, "SOCK_STREAM", "/tmp/srv.sock") == "3"


KERNEL = """
import contextlib, io, socket, sys
f = socket.socket(fileno=int(sys.argv[1])).makefile('rwb')
ns = {}
for line in f:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(eval(line), ns)
    f.write((repr(buf.getvalue()) + '\\n').encode()); f.flush()
"""

DRIVER = """
import socket, subprocess, sys
a, b = socket.socketpair()
subprocess.Popen([sys.executable, '/kernel.py', str(b.fileno())], pass_fds=[b.fileno()])
b.close()
f = a.makefile('rwb')
k = 0
while True:
    wait(f'/tmp/req-{k}')
    f.write((repr(open(f'/tmp/req-{k}').read()) + '\\n').encode()); f.flush()
    out(f'/tmp/resp-{k}', eval(f.readline()))
    k += 1
"""


def test_repl_over_a_socketpair_keeps_its_variables_on_both_sides(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.write_file("/kernel.py", KERNEL)
    ws.write_file("/t.py", SCRIPT_PRELUDE + DRIVER)
    ws.spawn(["python3", "/t.py"])

    def ask(w, k: int, code: str) -> str:
        put(w, f"/tmp/req-{k}", code)
        return _wait(w, f"/tmp/resp-{k}")

    assert ask(ws, 0, "x = 41") == ""
    assert ask(ws, 1, "x += 1; print(x)") == "42\n"
    kid = fork_one(family, ws)
    assert ask(kid, 2, "print(x); y = 'kid'") == "42\n"
    assert ask(ws, 2, "x += 100; print(x)") == "142\n"
    assert ask(kid, 3, "print(x, y)") == "42 kid\n"
    assert ask(ws, 3, "print(x, 'y' in dir())") == "142 False\n"


def test_unaccepted_connection_is_refused_and_source_untouched(family):
    ws = start_script(family, """
import socket
srv = socket.socket(socket.AF_UNIX); srv.bind('/tmp/l.sock'); srv.listen(1)
c = socket.socket(socket.AF_UNIX); c.connect('/tmp/l.sock')  # never accepted
out('/tmp/ready', '')
wait('/tmp/go')
s, _ = srv.accept(); c.send(b'ok'); out('/tmp/out', s.recv(2).decode())
time.sleep(1000)
""", "/tmp/ready")
    with pytest.raises(ForkError, match=r"process 2 \(python3\) fd \d+ is a unix socket .* not yet accepted"):
        ws.fork(1)
    put(ws, "/tmp/go", "")
    assert _wait(ws, "/tmp/out") == "ok"


def test_signalfd_keeps_its_mask(family):
    ws = start_script(family, """
import ctypes, os, signal, struct
lib = ctypes.CDLL(None, use_errno=True)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})
mask = ctypes.c_uint64((1 << (signal.SIGUSR1 - 1)) | (1 << (signal.SIGUSR2 - 1)))
fd = lib.signalfd(-1, ctypes.byref(mask), 0)
out('/tmp/ready', str(fd))
while True:
    info = os.read(fd, 128)                  # struct signalfd_siginfo
    signo = struct.unpack_from('I', info)[0]
    with open('/tmp/got', 'a') as f:
        f.write(f'{signo}\\n')
""", "/tmp/ready")
    pid = next(p.pid for p in ws.processes() if p.cmdline[:1] == ["python3"])
    (kid,) = ws.fork(1)
    family.append(kid)
    kid.kill(pid, signal.SIGUSR2)
    ws.kill(pid, signal.SIGUSR1)
    assert _wait(kid, "/tmp/got").split() == [str(int(signal.SIGUSR2))]
    assert _wait(ws, "/tmp/got").split() == [str(int(signal.SIGUSR1))]
    fdinfo = kid.read_file(f"/proc/{pid}/fdinfo/{ws.read_file('/tmp/ready').decode()}").decode()
    assert "sigmask:\t0000000000000a00" in fdinfo  # SIGUSR1 (10) and SIGUSR2 (12)


def test_pty_with_its_master_inside_the_workspace(family):
    ws = start_script(family, """
import os, pty, signal
pid, master = pty.fork()
if pid == 0:   # on the pty's slave, as its session leader: reverses every line it reads
    import sys
    for line in sys.stdin:
        print(line.strip()[::-1], flush=True)
    raise SystemExit
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
out('/tmp/ready', str(pid))
while True:
    signal.sigwait({signal.SIGUSR1})
    word = open('/tmp/word').read().strip()
    os.write(master, (word + '\\n').encode())
    got = b''
    while word[::-1].encode() not in got:
        got += os.read(master, 1024)
    out('/tmp/reply', got.decode(errors='replace'))
""", "/tmp/ready")
    driver = next(p.pid for p in ws.processes() if p.cmdline[:1] == ["python3"] and p.ppid == 1)
    (kid,) = ws.fork(1)
    family.append(kid)
    for w, word in ((kid, "forked"), (ws, "source")):
        w.write_file("/tmp/word", word)
        w.kill(driver, signal.SIGUSR1)
        assert word[::-1] in _wait(w, "/tmp/reply")
    tty = kid.run(f"readlink /proc/{ws.read_file('/tmp/ready').decode()}/fd/0").stdout.strip()
    assert tty.startswith(b"/dev/pts/")  # the same pty number in the child's own devpts


def test_inotify_keeps_its_watches(family):
    ws = start_script(family, """
import ctypes, os, signal, struct
lib = ctypes.CDLL(None, use_errno=True)
os.makedirs('/work/watched', exist_ok=True)
os.makedirs('/work/gone', exist_ok=True)
fd = lib.inotify_init1(0)
w0 = lib.inotify_add_watch(fd, b'/work/gone', 0x100)       # IN_CREATE, then removed: a hole
w1 = lib.inotify_add_watch(fd, b'/work/watched', 0x100)
lib.inotify_rm_watch(fd, w0)
out('/tmp/ready', f'{fd} {w1}')
while True:
    buf = os.read(fd, 4096)
    wd, mask, cookie, n = struct.unpack_from('iIII', buf)
    name = buf[16:16 + n].rstrip(b'\\0').decode()
    if mask & 0x8000:   # IN_IGNORED: the removed watch
        continue
    with open('/tmp/events', 'a') as f:
        f.write(f'{wd} {name}\\n')
""", "/tmp/ready")
    fd, wd = ws.read_file("/tmp/ready").decode().split()
    (kid,) = ws.fork(1)
    family.append(kid)
    kid.run("touch /work/watched/in-child")
    ws.run("touch /work/watched/in-source")
    assert _wait(kid, "/tmp/events").split() == [wd, "in-child"]  # same wd after the hole
    assert _wait(ws, "/tmp/events").split() == [wd, "in-source"]
