"""Forks carry epoll interest lists and inotify watches exactly where the kernel lets them be
seen, and refuse by name where not: proven with python3 programs in workspaces that check
their own state in the child and in the source, after ws.fork() and after
snapshot() + tpl.fork()."""

from __future__ import annotations

import pytest
from conftest import put, start_script
from conftest import wait_file as _wait

from bunshin.errors import ForkError

EPOLL = """
import ctypes, fcntl
libc = ctypes.CDLL(None, use_errno=True)
def add(ep, fd, data):
    assert libc.epoll_ctl(ep, 1, fd, struct.pack('=IQ', 1, data)) == 0, ctypes.get_errno()  # EPOLLIN
def entries(ep):
    return sorted(' '.join(line.split()[1:6]) for line in open(f'/proc/self/fdinfo/{ep}') if line.startswith('tfd:'))
def ready(ep):
    buf = ctypes.create_string_buffer(12 * 16)
    n = libc.epoll_wait(ep, buf, 16, 2000)
    return sorted(hex(struct.unpack_from('=IQ', buf, 12 * i)[1]) for i in range(n))

# D: the epoll is in a later process; only this (earlier) one still holds the watched file
rd, wd = os.pipe()
if os.fork() == 0:
    ep = libc.epoll_create1(0)
    add(ep, rd, 0xD1)
    os.close(rd)
    before = entries(ep)
    out('/tmp/d-ready', '')
    wait('/tmp/go')
    os.write(wd, b'd')
    out('/tmp/d-out', repr((ready(ep), entries(ep) == before)))
    time.sleep(1000)
wait('/tmp/d-ready')
os.close(wd)

ep = libc.epoll_create1(0)
ra, wa = os.pipe()                       # A: closed here, a dup of it holds the file
add(ep, ra, 0xA1)
eb = os.eventfd(0)                       # B: its number now names another file, both watched
add(ep, eb, 0xB1)
rc, wc = os.pipe()                       # C: only a later process (a child) holds it
add(ep, rc, 0xC1)
ra_dup, eb_dup = os.dup(ra), os.dup(eb)
if os.fork() == 0:
    os.close(ep)
    os.closerange(3, rc)
    os.closerange(rc + 1, 100)
    time.sleep(1000)
rb, wb = os.pipe()
os.close(ra)
os.close(rc)
os.dup2(rb, eb, inheritable=True)        # FD_CLOEXEC off at that number
os.close(rb)
add(ep, eb, 0xB2)
before = entries(ep)
out('/tmp/ready', f'{ep} {ra} {eb} {rc}')
wait('/tmp/go')
os.write(wa, b'a'); os.eventfd_write(eb_dup, 1); os.write(wb, b'b'); os.write(wc, b'c')
closed = []
for fd in (ra, rc):
    try:
        os.fstat(fd)
    except OSError:
        closed.append(fd)
out('/tmp/out', repr((ready(ep), entries(ep) == before, closed == [ra, rc], os.read(eb, 1),
                      fcntl.fcntl(eb, fcntl.F_GETFD))))
time.sleep(1000)
"""

WANT_MAIN = (["0xa1", "0xb1", "0xb2", "0xc1"], True, True, b"b", 0)
WANT_D = (["0xd1"], True)


def _check_epoll(w) -> None:
    put(w, "/tmp/go", "")
    assert eval(_wait(w, "/tmp/out")) == WANT_MAIN
    assert eval(_wait(w, "/tmp/d-out")) == WANT_D


def test_epoll_entries_of_closed_and_reused_numbers_are_carried(family):
    ws = start_script(family, EPOLL, "/tmp/ready")
    (kid,) = ws.fork(1)
    family.append(kid)
    for w in (kid, ws):  # the kid first: a source reading its pipes first would leave it none
        _check_epoll(w)


def test_epoll_entries_are_carried_by_every_fork_of_a_template(family):
    ws = start_script(family, EPOLL, "/tmp/ready")
    tpl = ws.snapshot()
    try:
        kids = tpl.fork(2)
        family.extend(kids)
    finally:
        tpl.close()
    for w in (*kids, ws):
        _check_epoll(w)


def test_epoll_watching_a_file_no_descriptor_holds_is_refused_by_name(family):
    ws = start_script(family, """
import ctypes, socket, array
libc = ctypes.CDLL(None, use_errno=True)
ep = libc.epoll_create1(0)
r, w = os.pipe()
assert libc.epoll_ctl(ep, 1, r, struct.pack('=IQ', 1, 7)) == 0
a, b = socket.socketpair()
a.sendmsg([b'x'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array('i', [r]))])
os.close(r)  # in flight in the socket only
out('/tmp/ready', f'{ep} {r}')
time.sleep(1000)
""", "/tmp/ready")
    ep, r = ws.read_file("/tmp/ready").decode().split()
    with pytest.raises(ForkError, match=rf"fd {ep}: epoll watches, under fd number {r}, a file that no descriptor"):
        ws.fork(1)
    assert ws.run("echo alive").stdout == b"alive\n"  # refused before anything changed
