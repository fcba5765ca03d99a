"""Forks carry TCP and UDP sockets: listeners and bound datagram sockets are recreated in the
child's own network namespace with their options; loopback connections between workspace
processes continue mid-stream (TCP_REPAIR), queued bytes included, on each side independently."""

from __future__ import annotations

import json
import time

import pytest
from conftest import SCRIPT_PRELUDE, fork_one, put, start_script
from conftest import wait_file as _wait

import bunshin
from bunshin.errors import ForkError

FETCH = "python3 -c \"import urllib.request as u; print(u.urlopen('{url}', timeout=5).read().decode())\""


def _fetch(w, url: str) -> str:
    r = w.run(FETCH.format(url=url), timeout=20)
    assert r.exit_code == 0, r
    return r.stdout.decode().strip()


def test_http_server_answers_in_source_and_child_independently(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.write_file("/srv/page.txt", "before")
    # on ::, IPv4 too (http.server turns IPV6_V6ONLY off): one listener, both families
    ws.spawn(["python3", "-m", "http.server", "8000", "--bind", "::", "--directory", "/srv"])
    deadline = time.monotonic() + 15
    while ws.run(FETCH.format(url="http://127.0.0.1:8000/page.txt")).exit_code != 0:
        assert time.monotonic() < deadline, "http.server never answered"
        time.sleep(0.05)
    kid = fork_one(family, ws)
    ws.write_file("/srv/page.txt", "source")
    kid.write_file("/srv/page.txt", "child")
    for w, text in ((kid, "child"), (ws, "source")):
        assert _fetch(w, "http://127.0.0.1:8000/page.txt") == text
        assert _fetch(w, "http://[::1]:8000/page.txt") == text


OPTIONS = """
S = socket.SOL_SOCKET
def opts(s):
    o = [s.getsockopt(S, socket.SO_REUSEADDR), s.getsockopt(S, socket.SO_REUSEPORT),
         s.getblocking(), s.getsockname()[:2]]
    if s.type == socket.SOCK_STREAM:
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 32)
        o += [s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY), info[0], struct.unpack_from('I', info, 28)[0]]
    if s.family == socket.AF_INET6:
        o.append(s.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY))
    return o
a = socket.socket()                                   # v4 any, reuseport, nodelay, non-blocking
a.setsockopt(S, socket.SO_REUSEPORT, 1); a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
a.bind(('0.0.0.0', 7001)); a.listen(7); a.setblocking(False)
b = socket.socket(socket.AF_INET6)                    # v6 loopback only, reuseaddr
b.setsockopt(S, socket.SO_REUSEADDR, 1); b.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
b.bind(('::1', 7002)); b.listen(3)
u = socket.socket(type=socket.SOCK_DGRAM); u.bind(('127.0.0.1', 7003))
u6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
u6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0); u6.bind(('::', 7004))
fresh = socket.socket()                               # never bound
uc = socket.socket(type=socket.SOCK_DGRAM); uc.connect(('127.0.0.1', 7003))   # connected to u
socks = [a, b, u, u6, uc]
out('/tmp/ready', json.dumps([opts(s) for s in socks]))
wait('/tmp/go')
tag = open('/tmp/go').read()
res = [opts(s) for s in socks]
# each still works: a connection is accepted, a datagram received
a.setblocking(True)
c = socket.create_connection(('127.0.0.1', 7001)); s, _ = a.accept(); c.send(tag.encode())
d = socket.create_connection(('::1', 7002)); t, _ = b.accept(); d.send(tag.encode())
socket.socket(type=socket.SOCK_DGRAM).sendto(tag.encode(), ('127.0.0.1', 7003))
socket.socket(type=socket.SOCK_DGRAM).sendto(tag.encode(), ('127.0.0.1', 7004))
got = [s.recv(100).decode(), t.recv(100).decode(), u.recv(100).decode(), u6.recv(100).decode()]
uc.send(b'via-connected'); got.append(u.recvfrom(100)[1] == uc.getsockname())
fresh.connect(('127.0.0.1', 7001))
out('/tmp/out', json.dumps([res, got]))
time.sleep(1000)
"""


def test_listeners_and_udp_keep_address_port_and_options(family):
    ws = start_script(family, OPTIONS, "/tmp/ready")
    before = json.loads(ws.read_file("/tmp/ready"))
    assert before[0][:3] == [0, 1, False] and before[0][4:] == [1, 10, 7]
    assert before[1][0] == 1 and before[1][-1] == 1 and before[1][-2] == 3
    kid = fork_one(family, ws)
    for w in (kid, ws):
        put(w, "/tmp/go", w.id)
        res, got = json.loads(_wait(w, "/tmp/out"))
        assert res == before
        assert got == [w.id] * 4 + [True]


CONN = """
HOST, FAM = sys.argv[1], getattr(socket, sys.argv[2])
pattern = b''.join(b'%09d\\n' % i for i in range(800000))   # 8 MB: more than the window holds
ls = socket.socket(FAM); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind((HOST, 9000)); ls.listen(5)
if os.fork() == 0:
    c = socket.create_connection((HOST, 9000))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c.setblocking(False)
    n = 0
    while True:  # fill the server's receive queue, then our own send queue (never sent)
        try:
            n += c.send(pattern[n:n + 65536])
        except BlockingIOError:
            break
    out('/tmp/c-ready', str(n))
    wait('/tmp/go')
    c.setblocking(True)
    got = b''
    while not got.endswith(b'.'):
        got += c.recv(65536)
    out('/tmp/client', got.decode())
    time.sleep(1000)
s, peer = ls.accept()
s.sendall(b'queued-for-client;')  # never read before the fork
wait('/tmp/c-ready')
out('/tmp/ready', '')
wait('/tmp/go')
n = int(open('/tmp/c-ready').read())
got = b''
while len(got) < n:
    got += s.recv(1 << 20)
tag = open('/tmp/go').read()
s.sendall(f'{len(got)}:{got == pattern[:n]}:{tag}.'.encode())
out('/tmp/server', str(len(got)))
time.sleep(1000)
"""


@pytest.mark.parametrize("host,fam", [("127.0.0.1", "AF_INET"), ("::1", "AF_INET6")])
def test_established_connection_continues_mid_stream_on_both_sides(family, host, fam):
    ws = start_script(family, CONN, "/tmp/ready", host, fam)
    n = int(ws.read_file("/tmp/c-ready"))
    assert n > 1 << 20  # megabytes queued: in the server's receive queue and the client's send queue
    kid = fork_one(family, ws)
    for w in (kid, ws):
        put(w, "/tmp/go", w.id)
    for w in (kid, ws):
        assert _wait(w, "/tmp/client") == f"queued-for-client;{n}:True:{w.id}."
        assert int(_wait(w, "/tmp/server")) == n


FLOOD = """
HOST = sys.argv[1]
FAM = getattr(socket, sys.argv[2])
ls = socket.socket(FAM); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind((HOST, 9001)); ls.listen(5)
if os.fork() == 0:  # the client: a counter, 8 bytes a number, as fast as the server takes it
    c = socket.create_connection((HOST, 9001))
    i = 0
    while True:
        c.sendall(b''.join(struct.pack('>Q', k) for k in range(i, i + 8192)))
        i += 8192
s, _ = ls.accept()
got, want, rest, last = 0, 0, b'', 0.0
while True:  # the server: reads on and checks that no byte is lost, doubled or reordered
    rest += s.recv(1 << 16)
    n = len(rest) // 8 * 8
    for (k,) in struct.iter_unpack('>Q', rest[:n]):
        if k != want:
            out('/tmp/flow', json.dumps(['bad', want, k]))
            time.sleep(1000)
        want += 1
    rest = rest[n:]
    if time.monotonic() - last > 0.05:
        out('/tmp/flow', json.dumps(['ok', want]))
        last = time.monotonic()
"""


def _flow(w, beyond: int, timeout: float = 20) -> list:
    """The flooded server's report once it has checked more than ``beyond`` numbers (or its
    report of a bad one)."""
    deadline = time.monotonic() + timeout
    while True:
        flow = json.loads(_wait(w, "/tmp/flow"))
        if flow[0] != "ok" or flow[1] > beyond or time.monotonic() > deadline:
            return flow
        time.sleep(0.02)


@pytest.mark.parametrize("host,fam", [("127.0.0.1", "AF_INET"), ("::1", "AF_INET6")])
def test_connection_in_full_flow_forks_with_no_byte_lost_or_doubled(family, host, fam):
    """Frozen ends do not stop the kernel: it goes on moving queued bytes from the client's
    socket to the server's until the window is full. A fork reads both queues at one moment of
    quiet, or a byte in between is lost (or, read the other way, sent twice)."""
    ws = start_script(family, FLOOD, "/tmp/flow", host, fam)
    tpl_seen = _flow(ws, 0)[1]
    for _ in range(4):  # each fork catches the stream at another point
        kid = fork_one(family, ws)
        for w in (kid, ws):
            flow = _flow(w, tpl_seen)
            assert flow[0] == "ok" and flow[1] > tpl_seen, (w.id, flow)
        tpl_seen = flow[1]


KEEPALIVE = """
import http.client
c = http.client.HTTPConnection('127.0.0.1', 8000, timeout=10)
def get():
    c.request('GET', '/page.txt')
    return c.getresponse().read().decode()
first = get()
port = c.sock.getsockname()[1]
out('/tmp/ready', first)
wait('/tmp/go')
second = get()
out('/tmp/out', json.dumps([first, second, c.sock.getsockname()[1] == port]))
time.sleep(1000)
"""


def test_keepalive_http_session_continues_in_both(family):
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.write_file("/srv/page.txt", "before")
    ws.spawn(["python3", "-m", "http.server", "8000", "--bind", "127.0.0.1", "--directory", "/srv",
              "--protocol", "HTTP/1.1"])
    deadline = time.monotonic() + 15
    while ws.run(FETCH.format(url="http://127.0.0.1:8000/page.txt")).exit_code != 0:
        assert time.monotonic() < deadline, "http.server never answered"
        time.sleep(0.05)
    ws.write_file("/t.py", SCRIPT_PRELUDE + KEEPALIVE)
    ws.spawn(["python3", "/t.py"])
    assert _wait(ws, "/tmp/ready") == "before"
    kids = ws.fork(2)  # two children of one template, and the source: three sessions
    family.extend(kids)
    for w in (*kids, ws):
        w.write_file("/srv/page.txt", w.id)
        put(w, "/tmp/go", "")
        assert json.loads(_wait(w, "/tmp/out")) == ["before", w.id, True]


PENDING = """
ls = socket.socket(); ls.bind(('127.0.0.1', 9100)); ls.listen(5)
c = socket.create_connection(('127.0.0.1', 9100))   # never accepted
c.send(b'ping')
out('/tmp/ready', '')
wait('/tmp/go')
s, _ = ls.accept()
out('/tmp/out', s.recv(10).decode())
time.sleep(1000)
"""


def test_unaccepted_connection_refused_source_untouched(family):
    ws = start_script(family, PENDING, "/tmp/ready")
    with pytest.raises(ForkError) as e:
        ws.fork(1)
    msg = str(e.value)
    assert "process 2 (python3) fd" in msg and "127.0.0.1:9100" in msg and "not yet accepted" in msg
    put(ws, "/tmp/go", "")
    assert _wait(ws, "/tmp/out") == "ping"


HALF_CLOSED = """
ls = socket.socket(); ls.bind(('127.0.0.1', 9200)); ls.listen(5)
c = socket.create_connection(('127.0.0.1', 9200))
s, _ = ls.accept()
port = c.getsockname()[1]
c.close()  # s is left in CLOSE_WAIT: its peer is gone
out('/tmp/ready', f'{s.fileno()} {port}')
time.sleep(1000)
"""


def test_half_closed_connection_refused_with_its_four_tuple(family):
    ws = start_script(family, HALF_CLOSED, "/tmp/ready")
    fd, port = ws.read_file("/tmp/ready").decode().split()
    with pytest.raises(ForkError, match=rf"process 2 \(python3\) fd {fd}: TCP socket 127.0.0.1:9200 -> "
                                        rf"127.0.0.1:{port} is in state CLOSE_WAIT"):
        ws.fork(1)
    assert ws.run("echo alive").stdout == b"alive\n"
