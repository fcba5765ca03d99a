"""Forks carry what a process set on its sockets (options, shutdown()) and the unix sockets
beyond pairs and listeners: datagram clients of a bound server, names relative to a directory.
Each program checks its own sockets: after the fork, in the child and in the source, it finds
what it found before (or, where looking consumes, what an identical set found before)."""

from __future__ import annotations

import pytest
from conftest import fork_one, put, start_script
from conftest import wait_file as _wait

from bunshin.errors import ForkError

OPTIONS = """
import fcntl
S, T = socket.SOL_SOCKET, socket.IPPROTO_TCP
RAW = [(S, socket.SO_PRIORITY, 4), (S, socket.SO_BINDTODEVICE, 16), (S, socket.SO_RCVBUF, 4),
       (S, socket.SO_SNDBUF, 4), (S, socket.SO_RCVTIMEO, 16), (S, socket.SO_SNDTIMEO, 16),
       (S, socket.SO_LINGER, 8), (S, socket.SO_KEEPALIVE, 4), (S, socket.SO_REUSEADDR, 4),
       (S, socket.SO_PASSCRED, 4), (S, socket.SO_MARK, 4), (S, 42, 4)]  # SO_PEEK_OFF
INET = [(T, socket.TCP_KEEPIDLE, 4), (T, socket.TCP_USER_TIMEOUT, 4), (T, socket.TCP_NODELAY, 4),
        (socket.IPPROTO_IP, socket.IP_TOS, 4)]
def state(s):
    got = []
    for level, opt, n in RAW + (INET if s.family == socket.AF_INET and s.type == socket.SOCK_STREAM else []):
        try:
            got.append(s.getsockopt(level, opt, n).hex())
        except OSError as e:
            got.append(e.errno)
    return got + [bool(fcntl.fcntl(s, fcntl.F_GETFL) & os.O_NONBLOCK)]
def dress(s, k):
    s.setsockopt(S, socket.SO_PRIORITY, 3 + k)
    s.setsockopt(S, socket.SO_RCVBUF, 40000 + 1000 * k); s.setsockopt(S, socket.SO_SNDBUF, 50000 + 1000 * k)
    s.setsockopt(S, socket.SO_RCVTIMEO, struct.pack('ll', 1 + k, 500000))
    s.setsockopt(S, socket.SO_SNDTIMEO, struct.pack('ll', 7, 250 * k))
    s.setsockopt(S, socket.SO_LINGER, struct.pack('ii', 1, 9 + k))
    s.setsockopt(S, socket.SO_KEEPALIVE, 1); s.setsockopt(S, socket.SO_REUSEADDR, 1)
    s.setsockopt(S, socket.SO_MARK, 77 + k); s.setsockopt(S, 42, 0)
    if s.family == socket.AF_UNIX:
        s.setsockopt(S, socket.SO_PASSCRED, 1)
    else:
        s.setsockopt(S, socket.SO_BINDTODEVICE, b'lo')
        s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, 0x10)
        if s.type == socket.SOCK_STREAM:
            s.setsockopt(T, socket.TCP_KEEPIDLE, 33 + k); s.setsockopt(T, socket.TCP_USER_TIMEOUT, 4000)
            s.setsockopt(T, socket.TCP_NODELAY, 1)
    s.setblocking(k % 2 == 0)
    return s
U = socket.AF_UNIX
socks = list(socket.socketpair(U, socket.SOCK_STREAM)) + list(socket.socketpair(U, socket.SOCK_DGRAM))
socks += [socket.socket(U, t) for t in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET)]
lu = socket.socket(U); lu.bind('/tmp/opt.sock'); lu.listen(2); socks.append(lu)
lt = socket.socket(); lt.bind(('127.0.0.1', 7100)); lt.listen(2); socks.append(lt)
socks += [socket.socket(), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)]
ct = socket.create_connection(('127.0.0.1', 7100)); st, _ = lt.accept(); socks += [ct, st]
for k, s in enumerate(socks):
    dress(s, k)
out('/tmp/ready', json.dumps([state(s) for s in socks]))
wait('/tmp/go')
out('/tmp/out', json.dumps([state(s) for s in socks]))
time.sleep(1000)
"""


def _fork(family, ws, how: str):
    if how == "fork":
        return fork_one(family, ws)
    tpl = ws.snapshot()
    try:
        (kid,) = tpl.fork(1)
        family.append(kid)
        return kid
    finally:
        tpl.close()


@pytest.mark.parametrize("how", ["fork", "snapshot"])
def test_socket_options_are_carried_for_unix_and_inet_sockets(family, how):
    ws = start_script(family, OPTIONS, "/tmp/ready")
    before = _wait(ws, "/tmp/ready")
    assert '"05000000"' in before and '"6c6f00"' in before  # SO_PRIORITY 5, SO_BINDTODEVICE lo: were set
    kid = _fork(family, ws, how)
    for w in (kid, ws):
        put(w, "/tmp/go", "")
        assert _wait(w, "/tmp/out") == before


SHUTDOWN = """
import errno
def probe(a, b):
    got = []
    for s in (a, b):
        data = []
        while True:
            try:
                m = s.recv(100, socket.MSG_DONTWAIT)
            except OSError as e:
                data.append(errno.errorcode[e.errno]); break
            data.append(m.decode())
            if not m:
                break
        got.append(data)
    for s in (a, b):
        try:
            s.send(b'z', socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL); got.append('sent')
        except OSError as e:
            got.append(errno.errorcode[e.errno])
    return got
def sets():
    out = []
    for t in (socket.SOCK_STREAM, socket.SOCK_SEQPACKET, socket.SOCK_DGRAM):
        for how in (socket.SHUT_RD, socket.SHUT_WR, socket.SHUT_RDWR):
            a, b = socket.socketpair(socket.AF_UNIX, t)
            a.send(b'to-b'); b.send(b'to-a')
            a.shutdown(how)
            out.append((a, b))
        a = socket.socket(socket.AF_UNIX, t); a.shutdown(socket.SHUT_WR)   # unconnected
        b = socket.socket(socket.AF_UNIX, t); b.shutdown(socket.SHUT_RD)
        out.append((a, b))
    return out
first, second = sets(), sets()
out('/tmp/ready', json.dumps([probe(a, b) for a, b in first]))
wait('/tmp/go')
out('/tmp/out', json.dumps([probe(a, b) for a, b in second]))
time.sleep(1000)
"""


@pytest.mark.parametrize("how", ["fork", "snapshot"])
def test_shutdown_state_and_queued_bytes_of_unix_sockets_are_carried(family, how):
    ws = start_script(family, SHUTDOWN, "/tmp/ready")
    before = _wait(ws, "/tmp/ready")
    assert "EPIPE" in before and '""' in before  # shut down ends: refused sends, EOF
    kid = _fork(family, ws, how)
    for w in (kid, ws):
        put(w, "/tmp/go", "")
        assert _wait(w, "/tmp/out") == before


DGRAM_CLIENTS = """
U, D = socket.AF_UNIX, socket.SOCK_DGRAM
c1 = socket.socket(U, D)                      # a lower fd than its server: made first in a child
s1 = socket.socket(U, D); s1.bind('/tmp/d.sock'); c1.connect('/tmp/d.sock')
os.makedirs('/tmp/sub', exist_ok=True); os.chdir('/tmp/sub')
sr = socket.socket(U, D); sr.bind('r.sock')   # relative to /tmp/sub
cr = socket.socket(U, D); cr.bind('cr.sock'); cr.connect('r.sock')
lr = socket.socket(U); lr.bind('l.sock'); lr.listen(1)
n0 = socket.socket(U); n0.connect('l.sock'); a0, _ = lr.accept()   # accepted: shares lr's name
os.chdir('/')
bs = socket.socket(U, socket.SOCK_SEQPACKET); bs.bind('/tmp/bs.sock')  # bound, not listening
if os.fork() == 0:                            # a server in a later process than its client
    s2 = socket.socket(U, D); s2.bind('\\0bunshin-dg')
    out('/tmp/q-ready', '')
    wait('/tmp/go')
    m, frm = s2.recvfrom(100)
    out('/tmp/q-out', repr((m, frm)))
    time.sleep(1000)
wait('/tmp/q-ready')
c2 = socket.socket(U, D); c2.connect('\\0bunshin-dg')
def report():
    return repr([c.getpeername() for c in (c1, cr, c2)] + [s.getsockname() for s in (sr, cr, lr, bs)])
out('/tmp/ready', report())
wait('/tmp/go')
c1.send(b'one'); cr.send(b'rel'); c2.send(b'two')
got = [s1.recvfrom(100), sr.recvfrom(100)]
n = socket.socket(U); n.connect('/tmp/sub/l.sock'); a, _ = lr.accept(); n.send(b'l'); got.append(a.recv(9))
n0.send(b'n0'); got.append(a0.recv(9))
bs.listen(1); n = socket.socket(U, socket.SOCK_SEQPACKET); n.connect('/tmp/bs.sock')
got.append(bs.accept()[0].fileno() > 0)
out('/tmp/out', report() + ' ' + repr(got))
time.sleep(1000)
"""


@pytest.mark.parametrize("how", ["fork", "snapshot"])
def test_datagram_clients_and_relative_names_are_carried(family, how):
    ws = start_script(family, DGRAM_CLIENTS, "/tmp/ready")
    names = _wait(ws, "/tmp/ready")
    assert names == repr(["/tmp/d.sock", "r.sock", b"\0bunshin-dg", "r.sock", "cr.sock", "l.sock", "/tmp/bs.sock"])
    kid = _fork(family, ws, how)
    for w in (kid, ws):
        put(w, "/tmp/go", "")
        assert _wait(w, "/tmp/out") == names + " " + repr([(b"one", None), (b"rel", "cr.sock"), b"l", b"n0", True])
        assert _wait(w, "/tmp/q-out") == repr((b"two", None))


def _refused(family, script: str, match: str) -> None:
    ws = start_script(family, script + "\nout('/tmp/ready', '')\nwait('/tmp/go')\nout('/tmp/out', check())\n"
                      "time.sleep(1000)\n", "/tmp/ready")
    with pytest.raises(ForkError, match=match):
        ws.fork(1)
    put(ws, "/tmp/go", "")  # untouched: the program finds its sockets as it left them
    assert _wait(ws, "/tmp/out") == "ok"


def test_descriptors_in_flight_are_refused_at_plan_time(family):
    _refused(family, """
import array
a, b = socket.socketpair()
r, w = os.pipe()
a.sendmsg([b'x'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array('i', [w]))])
def check():
    m, anc, _, _ = b.recvmsg(1, socket.CMSG_LEN(4))
    os.write(array.array('i', anc[0][2])[0], b'p')
    return 'ok' if (m, os.read(r, 1)) == (b'x', b'p') else 'bad'
""", r"process 2 \(python3\) fd \d+ is a unix socket .* descriptors queued \(SCM_RIGHTS")


def test_relative_name_whose_file_is_gone_is_refused(family):
    _refused(family, """
os.chdir('/tmp')
l = socket.socket(socket.AF_UNIX); l.bind('gone.sock'); l.listen(1)
os.unlink('/tmp/gone.sock')
def check():
    return 'ok' if l.getsockname() == 'gone.sock' else 'bad'
""", r"fd \d+ is a unix socket .* relative name b'gone.sock', whose socket file is not found")


def test_datagram_queued_from_an_unnamed_sender_is_refused(family):
    _refused(family, """
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); s.bind('/tmp/q.sock')
c = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); c.connect('/tmp/q.sock'); c.send(b'queued')
def check():
    return 'ok' if s.recv(9) == b'queued' else 'bad'
""", r"fd \d+ is a unix socket .* datagram queued from an unnamed socket: its sender cannot be told")


SERVER_QUEUE = """
U, D = socket.AF_UNIX, socket.SOCK_DGRAM
srv = socket.socket(U, D); srv.bind('/tmp/srv.sock'); srv.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
a = socket.socket(U, D); a.bind('/tmp/a.sock')
b = socket.socket(U, D); b.bind('\\0bunshin-b'); b.connect('/tmp/srv.sock')
a.sendto(b'a1', '/tmp/srv.sock'); b.send(b'b1'); a.sendto(b'a2', '/tmp/srv.sock')
srv.sendto(b'to-b', '\\0bunshin-b')                            # queued at a connected client
out('/tmp/ready', '')
wait('/tmp/go')
got = []
for _ in range(3):
    m, anc, _, frm = srv.recvmsg(9, socket.CMSG_SPACE(12))
    got.append((m, frm, struct.unpack('iII', anc[0][2])[0] == os.getpid()))
got.append(b.recvfrom(9))
a.sendto(b'a3', '/tmp/srv.sock'); got.append(srv.recvfrom(9))   # and they go on talking
out('/tmp/out', repr(got))
time.sleep(1000)
"""


@pytest.mark.parametrize("how", ["fork", "snapshot"])
def test_datagrams_queued_at_a_server_come_from_the_childs_copies_of_their_senders(family, how):
    ws = start_script(family, SERVER_QUEUE, "/tmp/ready")
    kid = _fork(family, ws, how)
    for w in (kid, ws):
        put(w, "/tmp/go", "")
        assert _wait(w, "/tmp/out") == repr([(b"a1", "/tmp/a.sock", True), (b"b1", b"\0bunshin-b", True),
                                              (b"a2", "/tmp/a.sock", True), (b"to-b", "/tmp/srv.sock"),
                                              (b"a3", "/tmp/a.sock")])


INET_SHUTDOWN = """
import errno, select
lt = socket.socket(); lt.bind(('127.0.0.1', 7200)); lt.listen(8)
def probe(socks):
    got = []
    for s in socks:
        p = select.poll(); p.register(s, select.POLLIN | select.POLLOUT | select.POLLRDHUP)
        got.append([ev for _, ev in p.poll(0)])
        for _ in range(2):
            try:
                got.append(s.recv(100, socket.MSG_DONTWAIT).decode())
            except OSError as e:
                got.append(errno.errorcode[e.errno])
    for s in socks:
        try:
            s.send(b'z', socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL); got.append('sent')
        except OSError as e:
            got.append(errno.errorcode[e.errno])
    return got
def shut(s, how):
    try:
        s.shutdown(how)
    except OSError as e:
        assert e.errno == errno.ENOTCONN
def sets(k):
    c = socket.create_connection(('127.0.0.1', 7200)); a, _ = lt.accept()
    a.send(b'x'); time.sleep(0.1); shut(c, socket.SHUT_RD)            # data queued, then EOF
    f = socket.socket(); shut(f, socket.SHUT_WR)                         # never connected
    u1 = socket.socket(type=socket.SOCK_DGRAM); u1.bind(('127.0.0.1', 7300 + k))
    u2 = socket.socket(type=socket.SOCK_DGRAM); u2.bind(('127.0.0.1', 7400 + k))
    u1.connect(u2.getsockname()); u2.connect(u1.getsockname()); shut(u1, socket.SHUT_RD)
    u3 = socket.socket(type=socket.SOCK_DGRAM); shut(u3, socket.SHUT_RDWR)
    return [c, a, f, u1, u2, u3]
first, second = sets(0), sets(1)
found = probe(first)
for s in first:  # what its probe sent would be queued at the fork (UDP: refused)
    s.close()
out('/tmp/ready', json.dumps(found))
wait('/tmp/go')
out('/tmp/out', json.dumps(probe(second)))
time.sleep(1000)
"""


@pytest.mark.parametrize("how", ["fork", "snapshot"])
def test_shutdown_state_of_tcp_and_udp_sockets_is_carried(family, how):
    ws = start_script(family, INET_SHUTDOWN, "/tmp/ready")
    before = _wait(ws, "/tmp/ready")
    assert '"x", ' in before and '""' in before  # the bytes queued, then EOF
    kid = _fork(family, ws, how)
    for w in (kid, ws):
        put(w, "/tmp/go", "")
        assert _wait(w, "/tmp/out") == before


CREDS = """
a, b = socket.socketpair()                                   # stream: runs of one sender each
da, db = socket.socketpair(type=socket.SOCK_DGRAM)
for s in (a, da):
    s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
for k in range(2):                                           # two senders
    if os.fork() == 0:
        wait(f'/tmp/turn-{k}')
        b.send(f's{k}'.encode()); db.send(f'd{k}'.encode())
        out(f'/tmp/sent-{k}', str(os.getpid())); time.sleep(1000)
for k in range(2):
    out(f'/tmp/turn-{k}', ''); wait(f'/tmp/sent-{k}')
def read(s):
    m, anc, _, _ = s.recvmsg(100, socket.CMSG_SPACE(12))
    pid, uid, gid = struct.unpack('iII', anc[0][2])
    return m.decode(), pid, uid, gid
out('/tmp/ready', '')
wait('/tmp/go')
out('/tmp/out', repr([read(s) for s in (a, a, da, da)]))
time.sleep(1000)
"""


@pytest.mark.parametrize("how", ["fork", "snapshot"])
def test_credentials_in_flight_name_the_childs_copies_of_their_senders(family, how):
    ws = start_script(family, CREDS, "/tmp/ready")
    p0, p1 = (int(_wait(ws, f"/tmp/sent-{k}")) for k in range(2))
    kid = _fork(family, ws, how)
    for w in (kid, ws):
        put(w, "/tmp/go", "")
        assert _wait(w, "/tmp/out") == repr([("s0", p0, 0, 0), ("s1", p1, 0, 0), ("d0", p0, 0, 0), ("d1", p1, 0, 0)])


def test_credentials_of_an_exited_sender_are_refused(family):
    _refused(family, """
a, b = socket.socketpair()
a.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
pid = os.fork()
if pid == 0:
    b.send(b'bye'); os._exit(0)
os.waitpid(pid, 0)
def check():
    return 'ok' if a.recv(9) == b'bye' else 'bad'
""", r"process 2 \(python3\) fd \d+ is a unix socket .* credentials \(SCM_CREDENTIALS\) name process \d+")


def test_relative_name_with_a_file_in_two_directories_is_refused(family):
    _refused(family, """
os.makedirs('/tmp/a'); os.makedirs('/tmp/b'); os.chdir('/tmp/a')
l = socket.socket(socket.AF_UNIX); l.bind('h.sock'); l.listen(1)
os.chdir('/'); os.link('/tmp/a/h.sock', '/tmp/b/h.sock')   # hard link: either could be where it was bound
def check():
    return 'ok' if l.getsockname() == 'h.sock' else 'bad'
""", r"fd \d+ is a unix socket .* relative name b'h.sock', whose socket file is in each of \['/tmp/a', '/tmp/b'\]")


UDP_QUEUE = """
D = socket.SOCK_DGRAM
srv = socket.socket(type=D); srv.bind(('0.0.0.0', 7500))                 # on all addresses
a = socket.socket(type=D); a.bind(('127.0.0.1', 7501))
c = socket.socket(socket.AF_INET6, D); c.bind(('::1', 7502)); c.connect(('::1', 7503))
d = socket.socket(socket.AF_INET6, D); d.bind(('::1', 7503)); d.sendto(b'to-c', ('::1', 7502))
a.sendto(b'a1', ('127.0.0.1', 7500))
a.sendto(b'a2', ('127.0.0.1', 7500)); srv.sendto(b'to-a', ('127.0.0.1', 7501))
time.sleep(0.2)
out('/tmp/ready', '')
wait('/tmp/go')
m, frm = c.recvfrom(9)
got = [srv.recvfrom(9), srv.recvfrom(9), a.recvfrom(9), (m, frm[:2])]
a.sendto(b'a3', ('127.0.0.1', 7500)); got.append(srv.recvfrom(9))         # and they go on talking
out('/tmp/out', repr(got))
time.sleep(1000)
"""


@pytest.mark.parametrize("how", ["fork", "snapshot"])
def test_udp_datagrams_queued_come_from_the_childs_copies_of_their_senders(family, how):
    ws = start_script(family, UDP_QUEUE, "/tmp/ready")
    kid = _fork(family, ws, how)
    a, srv = ("127.0.0.1", 7501), ("127.0.0.1", 7500)
    for w in (kid, ws):
        put(w, "/tmp/go", "")
        assert _wait(w, "/tmp/out") == repr([(b"a1", a), (b"a2", a), (b"to-a", srv), (b"to-c", ("::1", 7503)),
                                              (b"a3", a)])


def test_udp_datagram_from_a_socket_no_longer_there_is_refused(family):
    _refused(family, """
u = socket.socket(type=socket.SOCK_DGRAM); u.bind(('127.0.0.1', 7600))
t = socket.socket(type=socket.SOCK_DGRAM); t.sendto(b'x', ('127.0.0.1', 7600)); t.close()
time.sleep(0.2)
def check():
    return 'ok' if u.recv(9) == b'x' else 'bad'
""", r"process 2 \(python3\) fd \d+: UDP socket 127.0.0.1:7600 has a datagram queued that came from 127.0.0.1:\d+, "
       r"where 0 workspace UDP sockets are bound")


def test_empty_datagram_queued_is_refused_even_shut_down_for_reading(family):
    _refused(family, """
a, b = socket.socketpair(type=socket.SOCK_DGRAM)
b.send(b''); b.send(b'x'); a.shutdown(socket.SHUT_RD)
def check():
    return 'ok' if [a.recv(9), a.recv(9)] == [b'', b'x'] else 'bad'
""", r"process 2 \(python3\) fd \d+ is a unix socket .* with an empty datagram queued")


def test_empty_seqpacket_record_queued_is_refused(family):
    _refused(family, """
a, b = socket.socketpair(type=socket.SOCK_SEQPACKET)
b.send(b'x'); b.send(b'')  # last: the bytes queued add up without it
def check():
    return 'ok' if [a.recv(9), a.recv(9)] == [b'x', b''] else 'bad'
""", r"process 2 \(python3\) fd \d+ is a unix socket .* with an empty record queued")


def test_udp_error_pending_is_refused(family):
    _refused(family, """
u = socket.socket(type=socket.SOCK_DGRAM); u.bind(('127.0.0.1', 7610)); u.connect(('127.0.0.1', 7611))
u.send(b'x')  # nobody there: ICMP port unreachable, ECONNREFUSED pending
time.sleep(0.2)
def check():
    try:
        u.recv(9)
    except ConnectionRefusedError:
        return 'ok'
    return 'bad'
""", r"process 2 \(python3\) fd \d+: UDP socket 127.0.0.1:7610 .*has an error pending")


def test_a_socket_filter_is_refused(family):
    _refused(family, """
import ctypes
u = socket.socket(type=socket.SOCK_DGRAM); u.bind(('127.0.0.1', 7620))
code = ctypes.create_string_buffer(struct.pack('HBBI', 0x06, 0, 0, 0xffffffff))
u.setsockopt(socket.SOL_SOCKET, 26, struct.pack('HxxxxxxQ', 1, ctypes.addressof(code)))
def check():
    return 'ok'
""", r"process 2 \(python3\) fd \d+: UDP socket 127.0.0.1:7620 .*has a socket filter attached")


def test_empty_udp_datagram_queued_is_refused_naming_process_and_fd(family):
    _refused(family, """
u = socket.socket(type=socket.SOCK_DGRAM); u.bind(('127.0.0.1', 7630))
t = socket.socket(type=socket.SOCK_DGRAM); t.bind(('127.0.0.1', 7631)); t.sendto(b'', ('127.0.0.1', 7630))
time.sleep(0.2)
def check():
    return 'ok' if u.recv(9) == b'' else 'bad'
""", r"process 2 \(python3\) fd \d+: an empty UDP datagram is queued")
