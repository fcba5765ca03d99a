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


def _forked(family, script: str, *, template: bool) -> list:
    """The children (ws.fork(1), or two of a held template) then the source, each to be checked
    in that order: the kids first, as a source reading its pipes first would leave them none."""
    ws = start_script(family, script, "/tmp/ready")
    if not template:
        kids = ws.fork(1)
    else:
        tpl = ws.snapshot()
        try:
            kids = tpl.fork(2)
        finally:
            tpl.close()
    family.extend(kids)
    return [*kids, ws]


@pytest.mark.parametrize("template", [False, True], ids=["ws_fork", "tpl_fork_2"])
def test_epoll_entries_of_closed_and_reused_numbers_are_carried(family, template):
    for w in _forked(family, EPOLL, template=template):
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


INOTIFY = """
import ctypes, select
lib = ctypes.CDLL(None, use_errno=True)
def watches(fd):
    return sorted(' '.join(w for w in line.split() if w.startswith(('wd:', 'mask:')))
                  for line in open(f'/proc/self/fdinfo/{fd}') if line.startswith('inotify'))
def drain(fd):
    got = set()
    while select.select([fd], [], [], 1.0)[0]:
        buf = os.read(fd, 65536)
        i = 0
        while i < len(buf):
            wd, mask, _, n = struct.unpack_from('iIII', buf, i)
            got.add((wd, mask & 0xfff))
            i += 16 + n
    return sorted(got)
os.makedirs('/work/dir', exist_ok=True)
os.makedirs('/work/gone-dir', exist_ok=True)
for name in ('/work/gone-file', '/work/other-file', '/work/dir/kept'):
    open(name, 'w').close()
fd = lib.inotify_init1(os.O_NONBLOCK)      # a lower number than the file it watches below
w1 = lib.inotify_add_watch(fd, b'/work/dir', 0x100 | 0x20 | 0x04000000)  # IN_CREATE | IN_OPEN | IN_EXCL_UNLINK
hole = lib.inotify_add_watch(fd, b'/', 0x100)
lib.inotify_rm_watch(fd, hole)
w2 = lib.inotify_add_watch(fd, b'/work/gone-file', 0x2)             # IN_MODIFY, held here
w4 = lib.inotify_add_watch(fd, b'/work/other-file', 0x2)            # held by a later process
w5 = lib.inotify_add_watch(fd, b'/work/gone-dir', 0x4)              # IN_ATTRIB, a later cwd
h = os.open('/work/gone-file', os.O_RDWR)
if os.fork() == 0:
    other = os.open('/work/other-file', os.O_RDWR)
    kept = os.open('/work/dir/kept', os.O_RDONLY)   # reopened by the fork: no event for that
    os.chdir('/work/gone-dir')
    out('/tmp/c-ready', '')
    wait('/tmp/go')
    os.write(other, b'x'); os.chmod('.', 0o700)
    time.sleep(1000)
wait('/tmp/c-ready')
os.unlink('/work/gone-file'); os.unlink('/work/other-file'); os.rmdir('/work/gone-dir')
drain(fd)
before = watches(fd)
out('/tmp/ready', repr(before))
wait('/tmp/go')
os.write(h, b'x'); os.mkdir('/work/dir/new')
out('/tmp/out', repr((drain(fd), watches(fd) == before, (w1, w2, w4, w5))))
time.sleep(1000)
"""


def _check_inotify(w) -> None:
    put(w, "/tmp/go", "")
    events, same, (w1, w2, w4, w5) = eval(_wait(w, "/tmp/out"))
    assert (w1, w2, w4, w5) == (1, 3, 4, 5)  # wd 2 was a hole
    assert same
    assert events == [(w1, 0x100), (w2, 0x2), (w4, 0x2), (w5, 0x4)]


@pytest.mark.parametrize("template", [False, True], ids=["ws_fork", "tpl_fork_2"])
def test_inotify_watches_on_deleted_files_are_carried(family, template):
    for w in _forked(family, INOTIFY, template=template):
        _check_inotify(w)


def test_inotify_queued_events_are_dropped_and_said(family, caplog):
    ws = start_script(family, """
import ctypes, select
lib = ctypes.CDLL(None, use_errno=True)
os.makedirs('/work/dir', exist_ok=True)
fd = lib.inotify_init1(os.O_NONBLOCK)
lib.inotify_add_watch(fd, b'/work/dir', 0x100)
os.mkdir('/work/dir/a')                 # queued, never read before the fork
out('/tmp/ready', str(fd))
wait('/tmp/go')
os.mkdir('/work/dir/b')
select.select([fd], [], [], 5)
buf = os.read(fd, 4096)
out('/tmp/out', buf[16:].rstrip(b'\\0').decode())
time.sleep(1000)
""", "/tmp/ready")
    fd = ws.read_file("/tmp/ready").decode()
    with caplog.at_level("WARNING", logger="bunshin.fork.resources.inotify"):
        (kid,) = ws.fork(1)
    family.append(kid)
    assert f"fd {fd}: inotify has 32 bytes of unread events" in caplog.text
    put(kid, "/tmp/go", "")
    assert _wait(kid, "/tmp/out") == "b"  # "a" was queued in the source only
    put(ws, "/tmp/go", "")
    got = _wait(ws, "/tmp/out")
    assert got.startswith("a\0") and got.endswith("\0b"), got  # the source keeps its queue


def test_inotify_watches_on_regular_files_of_both_layers_are_carried(family):
    # overlayfs gives a file's stat the device of its layer, not the one the watch shows
    ws = start_script(family, """
import ctypes, select
lib = ctypes.CDLL(None, use_errno=True)
open('/work-file', 'w').close()                  # in the workspace's upper layer
fd = lib.inotify_init1(0)
w1 = lib.inotify_add_watch(fd, b'/work-file', 0x4)         # IN_ATTRIB
w2 = lib.inotify_add_watch(fd, b'/etc/hostname', 0x4)      # in the image's lower layer
out('/tmp/ready', '')
wait('/tmp/go')
os.chmod('/work-file', 0o600); os.chmod('/etc/hostname', 0o600)
got = set()
while select.select([fd], [], [], 1.0)[0]:
    buf = os.read(fd, 4096)
    got |= {struct.unpack_from('iI', buf, i)[:2] for i in range(0, len(buf), 16)}
out('/tmp/out', repr(sorted(got)))
time.sleep(1000)
""", "/tmp/ready")
    (kid,) = ws.fork(1)
    family.append(kid)
    for w in (kid, ws):
        put(w, "/tmp/go", "")
        assert eval(_wait(w, "/tmp/out")) == [(1, 0x4), (2, 0x4)]


def test_inotify_watch_on_a_deleted_file_only_mapped_is_refused_by_name(family):
    ws = start_script(family, """
import ctypes, mmap
lib = ctypes.CDLL(None, use_errno=True)
with open('/work-mapped', 'wb') as f:
    f.write(b'x' * 4096)
fd = lib.inotify_init1(0)
lib.inotify_add_watch(fd, b'/work-mapped', 0x2)
lib.mmap.restype = ctypes.c_void_p
with open('/work-mapped', 'rb') as f:   # (mmap.mmap would keep a descriptor of its own)
    assert lib.mmap(None, 4096, mmap.PROT_READ, mmap.MAP_PRIVATE, f.fileno(), 0) not in (None, 2**64 - 1)
os.unlink('/work-mapped')   # only the mapping keeps the inode, and so the watch
out('/tmp/ready', '')
time.sleep(1000)
""", "/tmp/ready")
    with pytest.raises(ForkError, match=r"process 2 \(python3\) fd 3: inotify watch 1 is on /work-mapped \(deleted\), which only a mapping keeps"):
        ws.fork(1)
    assert ws.run("echo alive").stdout == b"alive\n"


def test_inotify_watch_whose_path_is_not_found_is_refused_at_plan_time(family, monkeypatch):
    from bunshin.fork.resources import inotify

    ws = start_script(family, """
import ctypes
lib = ctypes.CDLL(None, use_errno=True)
fd = lib.inotify_init1(0)
lib.inotify_add_watch(fd, b'/usr/share', 0x100)   # in the image: past a walk cut short
out('/tmp/ready', '')
time.sleep(1000)
""", "/tmp/ready")
    monkeypatch.setattr(inotify, "_WALK_LIMIT", 3)
    with pytest.raises(ForkError, match=r"process 2 \(python3\) fd 3: inotify watch 1 is on inode \d+, which has no path"):
        ws.fork(1)
    assert ws.run("echo alive").stdout == b"alive\n"  # refused before anything changed


def test_inotify_gets_no_event_from_the_forks_own_reopening(family):
    ws = start_script(family, """
import ctypes, select
lib = ctypes.CDLL(None, use_errno=True)
os.makedirs('/work/dir', exist_ok=True)
open('/work/dir/kept', 'w').close()
fd = lib.inotify_init1(0)
lib.inotify_add_watch(fd, b'/work/dir', 0x100 | 0x20)      # IN_CREATE | IN_OPEN
if os.fork() == 0:
    kept = os.open('/work/dir/kept', os.O_RDONLY)        # the fork reopens it in the child
    out('/tmp/c-ready', '')
    time.sleep(1000)
wait('/tmp/c-ready')
while select.select([fd], [], [], 0.2)[0]:
    os.read(fd, 4096)
out('/tmp/ready', '')
wait('/tmp/go')
os.mkdir('/work/dir/new')
select.select([fd], [], [], 5)
time.sleep(0.2)
buf = os.read(fd, 4096)
out('/tmp/out', repr([struct.unpack_from('iI', buf, i)[1] & 0xfff for i in range(0, len(buf), 32)]))
time.sleep(1000)
""", "/tmp/ready")
    (kid,) = ws.fork(1)
    family.append(kid)
    for w in (kid, ws):
        put(w, "/tmp/go", "")
        assert eval(_wait(w, "/tmp/out")) == [0x100]  # IN_CREATE "new": nothing before it


SYMLINK_WATCH = """
import ctypes, select
lib = ctypes.CDLL(None, use_errno=True)
os.makedirs('/work', exist_ok=True)
open('/work/target', 'w').close()
os.symlink('/work/target', '/work/link')
fd = lib.inotify_init1(os.O_NONBLOCK)
wd = lib.inotify_add_watch(fd, b'/work/link', 0x4 | 0x02000000)   # IN_ATTRIB on the link itself
out('/tmp/ready', '')
wait('/tmp/go')
def events():
    got = []
    while select.select([fd], [], [], 0.5)[0]:
        buf = os.read(fd, 4096)
        got += [struct.unpack_from('iI', buf, i) for i in range(0, len(buf), 16)]
    return [(w == wd, m & 0xfff) for w, m in got]
os.chmod('/work/target', 0o600)                                     # not the link's event
after_target = events()
os.utime('/work/link', follow_symlinks=False)                       # the link's
out('/tmp/out', repr((after_target, events())))
time.sleep(1000)
"""


@pytest.mark.parametrize("template", [False, True], ids=["ws_fork", "tpl_fork_2"])
def test_an_inotify_watch_on_a_symlink_stays_on_the_symlink(family, template):
    for w in _forked(family, SYMLINK_WATCH, template=template):
        put(w, "/tmp/go", "")
        assert eval(_wait(w, "/tmp/out")) == ([], [(True, 0x4)])
