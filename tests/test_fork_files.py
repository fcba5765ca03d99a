"""Descriptors a fork carries exactly: O_PATH descriptors, open flags, modes and owners of
reopened and deleted files, memfd seals, file locks, FIFOs without peers, deleted
directories, namespace descriptors; and the refusals, made before anything changes.

A program in the workspace sets the state up, the test forks (ws.fork() and a template's
fork), and the program reports what it sees, in the child and in the source (which goes on
as a fork of the same template)."""

from __future__ import annotations

import json
import os
import signal

import pytest
from conftest import SCRIPT_PRELUDE, signal_and_read, wait_file

import bunshin
from bunshin.errors import ForkError

SERVE = r"""
import errno, fcntl, signal, stat
def serve(report):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    out("/tmp/ready", "")
    while True:
        signal.sigwait({signal.SIGUSR1})
        try:
            text = json.dumps(report())
        except Exception as e:
            text = json.dumps({"error": repr(e)})
        out("/tmp/report", text)
def fd_facts(fd):
    st = os.fstat(fd)
    return {"link": os.readlink(f"/proc/self/fd/{fd}"), "fl": fcntl.fcntl(fd, fcntl.F_GETFL),
            "fd": fcntl.fcntl(fd, fcntl.F_GETFD), "type": stat.S_IFMT(st.st_mode),
            "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid, "gid": st.st_gid}
def from_another(job):
    # what another process of the same workspace sees (a lock is never in the way of its owner)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.write(w, json.dumps(job()).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)
"""

HOWS = ["ws.fork", "template.fork", "two-children"]  # two-children: the second of one tpl.fork(2)


def _start(family, script: str, isolation: str | None = None) -> tuple[bunshin.Workspace, int]:
    ws = bunshin.Workspace.create(isolation=isolation)
    family.append(ws)
    ws.write_file("/t.py", SCRIPT_PRELUDE + SERVE + script)
    pid = ws.spawn(["python3", "/t.py"])
    wait_file(ws, "/tmp/ready")
    return ws, pid


def _fork(family, ws, how: str) -> bunshin.Workspace:
    if how == "ws.fork":
        kids = ws.fork(1)
    else:
        with ws.snapshot() as tpl:
            kids = tpl.fork(1 if how == "template.fork" else 2)
    family.extend(kids)
    return kids[-1]


def _report(w, pid: int) -> dict:
    got = json.loads(signal_and_read(w, pid, signal.SIGUSR1, "/tmp/report"))
    assert "error" not in got, got
    return got


def _reports(family, script: str, how: str,
             isolation: str | None = None) -> tuple[dict, dict, dict, bunshin.Workspace]:
    """The program's report before the fork, the source's and the child's after it, and the
    child."""
    ws, pid = _start(family, script, isolation)
    before = _report(ws, pid)
    kid = _fork(family, ws, how)
    return before, _report(ws, pid), _report(kid, pid), kid


O_PATHS = r"""
os.makedirs("/work/op", exist_ok=True)
open("/work/op/f", "w").write("x")
os.symlink("f", "/work/op/link")
os.mkfifo("/work/op/fifo")
paths = {"file": ("/work/op/f", os.O_PATH), "link": ("/work/op/link", os.O_PATH | os.O_NOFOLLOW),
         "dir": ("/work/op", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC), "dev": ("/dev/null", os.O_PATH),
         "fifo": ("/work/op/fifo", os.O_PATH)}
fds = {k: os.open(p, fl) for k, (p, fl) in paths.items()}
os.set_inheritable(fds["file"], True)  # Python opens close-on-exec: one without
os.symlink("nowhere", "/work/op/gone")
fds["gone"] = os.open("/work/op/gone", os.O_PATH | os.O_NOFOLLOW)
os.lchown("/work/op/gone", 7, 8)
os.unlink("/work/op/gone")
open("/work/op/ghost", "w").write("boo")
fds["ghost"] = os.open("/work/op/ghost", os.O_PATH)
os.unlink("/work/op/ghost")
def report():
    r = {k: fd_facts(fd) for k, fd in fds.items()}
    for k, (p, _) in paths.items():  # the file at that path in this workspace's own root
        r[k]["own"] = os.fstat(fds[k]).st_ino == os.lstat(p).st_ino
    r["link-to"] = os.readlink("", dir_fd=fds["link"])
    r["gone-to"] = os.readlink("", dir_fd=fds["gone"])
    r["ghost-read"] = open(f"/proc/self/fd/{fds['ghost']}").read()
    r["in-dir"] = os.stat("f", dir_fd=fds["dir"]).st_size
    return r
serve(report)
"""


@pytest.mark.parametrize("how", HOWS)
def test_o_path_descriptors(family, how):
    before, src, kid, child = _reports(family, O_PATHS, how)
    assert before["link"]["type"] == 0o120000 and before["link"]["fl"] & 0o10000000  # O_PATH
    assert before["dir"]["fd"] == 1 and before["file"]["fd"] == 0
    assert all(before[k]["own"] for k in ("file", "link", "dir", "dev", "fifo"))
    assert before["gone"]["link"] == "/work/op/gone (deleted)" and before["gone-to"] == "nowhere"
    assert (before["gone"]["uid"], before["gone"]["gid"]) == (7, 8)
    assert before["ghost"]["link"] == "/work/op/ghost (deleted)" and before["ghost-read"] == "boo"
    assert src == before and kid == before
    assert child.run("test -e /work/op/gone -o -L /work/op/gone").exit_code == 1


FLAGS_AND_MODES = r"""
os.umask(0o077)  # a copy made under it must still get the file's own mode
os.makedirs("/work/fm", exist_ok=True)
fds = {}
fds["append"] = os.open("/work/fm/app.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK, 0o600)
os.fchmod(fds["append"], 0o604)
os.set_inheritable(fds["append"], True)  # Python opens close-on-exec: one without
fds["sync"] = os.open("/work/fm/sync.bin", os.O_RDWR | os.O_CREAT | os.O_DSYNC | os.O_NOATIME | os.O_CLOEXEC, 0o600)
try:
    fds["direct"] = os.open("/work/fm/direct.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
except OSError:  # a root file system without O_DIRECT
    pass
fds["shm"] = os.open("/dev/shm/seg", os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
os.fchmod(fds["shm"], 0o640)
os.write(fds["shm"], b"shm")
g = os.open("/work/fm/ghost", os.O_RDWR | os.O_CREAT, 0o600)
os.write(g, b"ghost data")
os.fchown(g, 1234, 5678)  # before the mode: a chown drops set-user-ID
os.fchmod(g, 0o4751)
fds["ghost"] = os.open("/work/fm/ghost", os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)  # read-only, deleted
fds["ghost-rw"] = os.open("/work/fm/ghost", os.O_RDWR)  # another open of it: one file still
os.close(g)
os.unlink("/work/fm/ghost")
os.lseek(fds["ghost"], 6, os.SEEK_SET)
fds["replaced"] = os.open("/work/fm/replaced", os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
os.write(fds["replaced"], b"old")
os.unlink("/work/fm/replaced")
open("/work/fm/replaced", "w").write("new")  # its name taken by another file
def report():
    r = {k: fd_facts(fd) for k, fd in fds.items()}
    r["replaced"]["link"] = r["replaced"]["link"].endswith(" (deleted)")  # a copy's own name
    r["ghost-nlink"] = os.fstat(fds["ghost"]).st_nlink
    r["ghost-same"] = os.fstat(fds["ghost"]).st_ino == os.fstat(fds["ghost-rw"]).st_ino
    r["ghost-read"] = os.pread(fds["ghost"], 100, 0).decode()
    r["replaced-read"] = os.pread(fds["replaced"], 100, 0).decode()
    try:
        os.write(fds["ghost"], b"x")
        r["ghost-write"] = "written"
    except OSError as e:
        r["ghost-write"] = errno.errorcode[e.errno]
    r["shm-read"] = os.pread(fds["shm"], 10, 0).decode()
    return r
serve(report)
"""


@pytest.mark.parametrize("how", HOWS)
def test_open_flags_modes_and_owners_of_files(family, how):
    before, src, kid, child = _reports(family, FLAGS_AND_MODES, how)
    assert before["append"]["fl"] & (os.O_APPEND | os.O_NONBLOCK) == os.O_APPEND | os.O_NONBLOCK
    assert before["sync"]["fl"] & os.O_DSYNC and before["sync"]["fd"] == 1 and before["append"]["fd"] == 0
    assert before["append"]["mode"] == 0o604 and before["shm"]["mode"] == 0o640
    assert (before["ghost"]["mode"], before["ghost"]["uid"], before["ghost"]["gid"]) == (0o4751, 1234, 5678)
    assert before["ghost-write"] == "EBADF" and before["ghost-nlink"] == 0 and before["ghost-same"]
    assert before["ghost"]["link"] == "/work/fm/ghost (deleted)" and before["ghost"]["fl"] & os.O_NOFOLLOW
    assert src == before and kid == before
    assert child.run("test -e /work/fm/ghost").exit_code == 1
    assert child.read_file("/work/fm/replaced") == b"new"


MEMFDS = r"""
import mmap
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE, F_SEAL_FUTURE_WRITE = 1, 2, 4, 8, 16
fds = {}
fds["sealed"] = os.memfd_create("sealed", os.MFD_ALLOW_SEALING)
os.write(fds["sealed"], b"frozen")
fcntl.fcntl(fds["sealed"], fcntl.F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE)
os.fchmod(fds["sealed"], 0o640)
fds["plain"] = os.memfd_create("plain", 0)  # no sealing: F_SEAL_SEAL
os.write(fds["plain"], b"plain")
fcntl.fcntl(fds["plain"], fcntl.F_SETFL, os.O_APPEND | os.O_NONBLOCK)
fds["ro"] = os.open(f"/proc/self/fd/{fds['plain']}", os.O_RDONLY)  # another open, read-only
fds["path"] = os.open(f"/proc/self/fd/{fds['sealed']}", os.O_PATH)
fds["mapped"] = os.memfd_create("mapped", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
os.ftruncate(fds["mapped"], 4096)
mem = mmap.mmap(fds["mapped"], 4096, flags=mmap.MAP_SHARED)  # writable, then sealed for new ones
fcntl.fcntl(fds["mapped"], fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
def report():
    r = {k: fd_facts(fd) for k, fd in fds.items()}
    for k, fd in fds.items():
        if k == "path":  # O_PATH: nothing but what it names
            r[k]["same"] = os.fstat(fd).st_ino == os.fstat(fds["sealed"]).st_ino
            continue
        r[k]["seals"] = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        r[k]["data"] = os.pread(fd, 20, 0).decode()
    try:
        os.write(fds["sealed"], b"x")
        r["sealed-write"] = "written"
    except OSError as e:
        r["sealed-write"] = errno.errorcode[e.errno]
    mem[:5] = b"still"  # the old mapping stays writable
    r["mapped-data"] = os.pread(fds["mapped"], 5, 0).decode()
    mem[:5] = bytes(5)
    return r
serve(report)
"""


@pytest.mark.parametrize("how", HOWS)
def test_memfd_seals_flags_and_modes(family, how):
    before, src, kid, _ = _reports(family, MEMFDS, how)
    assert before["sealed"]["seals"] == 2 | 4 | 8 and before["sealed"]["mode"] == 0o640
    assert before["plain"]["seals"] == 1 and before["plain"]["fl"] & os.O_APPEND
    assert before["ro"]["fl"] & os.O_ACCMODE == os.O_RDONLY and before["ro"]["data"] == "plain"
    assert before["mapped"]["seals"] == 16 and before["mapped-data"] == "still"
    assert before["sealed-write"] == "EPERM" and before["path"]["same"]
    assert src == before and kid == before


ANON_SHMEM = r"""
import ctypes, mmap
anon = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED)  # a shmem file with no name
at = ctypes.addressof(ctypes.c_char.from_buffer(anon))
fd = os.open(f"/proc/self/map_files/{at:x}-{at + 4096:x}", os.O_RDWR | os.O_NONBLOCK)
def report():
    r = {"anon": fd_facts(fd)}
    os.pwrite(fd, b"via-fd", 0)  # the descriptor and the mapping: one object
    r["anon-mapped"] = bytes(anon[:6]).decode()
    r["anon-maps"] = [l.split(None, 5)[-1].strip() for l in open("/proc/self/maps") if l.startswith(f"{at:x}-")]
    anon[:6] = bytes(6)
    return r
serve(report)
"""


@pytest.mark.parametrize("how", HOWS)
def test_descriptor_of_an_anonymous_shared_mapping(family, how):
    # A trusted workspace: only /proc/PID/map_files opens such a mapping's object, and it
    # needs CAP_SYS_ADMIN in the host's user namespace, which no process of a sandbox has
    before, src, kid, _ = _reports(family, ANON_SHMEM, how, isolation="trusted")
    assert before["anon-mapped"] == "via-fd" and before["anon"]["fl"] & os.O_NONBLOCK
    assert before["anon"]["link"] == before["anon-maps"][0] == "/dev/zero (deleted)"
    assert src == before and kid == before


def test_a_sandbox_cannot_open_map_files(no_leaks):
    with bunshin.Workspace.create(isolation="sandbox") as ws:
        r = ws.run("python3 -c 'import mmap, os; m = mmap.mmap(-1, 4096); "
                   "os.open(\"/proc/self/map_files/\" + os.listdir(\"/proc/self/map_files\")[0], os.O_RDONLY)'")
        assert r.exit_code == 1 and b"PermissionError" in r.stderr, r


LOCKS = r"""
import struct
def lk(kind, start, length):
    return struct.pack("hhqqi4x", kind, 0, start, length, 0)
def unpack(b):
    t, _, start, length, pid = struct.unpack("hhqqi4x", b)
    return [t, start, length, pid]
os.makedirs("/work/lk", exist_ok=True)
fds = {}
fds["posix"] = os.open("/work/lk/data", os.O_RDWR | os.O_CREAT, 0o644)
os.write(fds["posix"], bytes(100))
fcntl.fcntl(fds["posix"], fcntl.F_SETLK, lk(fcntl.F_WRLCK, 10, 5))
fds["ofd"] = os.open("/work/lk/data", os.O_RDWR)
fcntl.fcntl(fds["ofd"], fcntl.F_OFD_SETLK, lk(fcntl.F_RDLCK, 50, 0))
fds["flock"] = os.open("/work/lk/flocked", os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fds["flock"], fcntl.LOCK_EX)
fds["ghost"] = os.open("/work/lk/ghost", os.O_RDWR | os.O_CREAT, 0o644)
os.write(fds["ghost"], bytes(10))
fcntl.fcntl(fds["ghost"], fcntl.F_SETLK, lk(fcntl.F_WRLCK, 0, 0))
os.unlink("/work/lk/ghost")
shared = os.open("/work/lk/shared", os.O_RDWR | os.O_CREAT, 0o644)  # one open file, two processes
fcntl.fcntl(shared, fcntl.F_OFD_SETLK, lk(fcntl.F_WRLCK, 0, 0))
fds["shared"] = shared
fds["memfd"] = os.memfd_create("locked")
fcntl.fcntl(fds["memfd"], fcntl.F_OFD_SETLK, lk(fcntl.F_WRLCK, 0, 1))
fcntl.flock(fds["memfd"], fcntl.LOCK_SH)
if os.fork() == 0:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    while True:
        signal.pause()
me = os.getpid()
def probe():
    r = {}
    def mine(k, flags=os.O_RDWR):
        return os.open(f"/proc/{me}/fd/{fds[k]}", flags)
    fd = mine("posix")
    r["posix-held"] = unpack(fcntl.fcntl(fd, fcntl.F_GETLK, lk(fcntl.F_WRLCK, 0, 0)))
    r["posix-free"] = unpack(fcntl.fcntl(fd, fcntl.F_GETLK, lk(fcntl.F_WRLCK, 0, 10)))
    try:
        fcntl.fcntl(fd, fcntl.F_SETLK, lk(fcntl.F_WRLCK, 12, 1))
        r["posix-take"] = "taken"
    except OSError as e:
        r["posix-take"] = errno.errorcode[e.errno]
    r["ofd-held"] = unpack(fcntl.fcntl(fd, fcntl.F_OFD_GETLK, lk(fcntl.F_WRLCK, 60, 1)))
    r["ofd-read-ok"] = unpack(fcntl.fcntl(fd, fcntl.F_OFD_GETLK, lk(fcntl.F_RDLCK, 60, 1)))
    r["ghost-held"] = unpack(fcntl.fcntl(mine("ghost"), fcntl.F_GETLK, lk(fcntl.F_WRLCK, 0, 0)))
    r["memfd-held"] = unpack(fcntl.fcntl(mine("memfd"), fcntl.F_OFD_GETLK, lk(fcntl.F_RDLCK, 0, 0)))
    r["memfd-flock"] = flock_state(mine("memfd"))
    r["shared-held"] = unpack(fcntl.fcntl(mine("shared"), fcntl.F_OFD_GETLK, lk(fcntl.F_RDLCK, 0, 0)))
    r["flock"] = flock_state(mine("flock"))
    return r
def flock_state(fd):
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return "free"
    except BlockingIOError:
        return "held"
def report():
    r = {k: fd_facts(fd) for k, fd in fds.items()}
    r["ghost"]["link"] = r["ghost"]["link"].endswith(" (deleted)")
    # the owner itself may take the range again (its own lock); the shared one is the child
    # process's too: kcmp says one open file
    r["probe"] = from_another(probe)
    return r
serve(report)
"""


@pytest.mark.parametrize("how", HOWS)
def test_posix_ofd_and_flock_locks_are_held_in_the_child(family, how):
    before, src, kid, _ = _reports(family, LOCKS, how)
    p = before["probe"]
    assert p["posix-held"][:3] == [1, 10, 5] and p["posix-held"][3] > 0  # F_WRLCK by the program
    assert p["posix-free"][0] == 2 and p["posix-take"] == "EAGAIN"  # F_UNLCK
    assert p["ofd-held"] == [0, 50, 0, -1] and p["ofd-read-ok"][0] == 2
    assert p["memfd-held"] == [1, 0, 1, -1] and p["memfd-flock"] == "held"
    assert p["ghost-held"][0] == 1 and p["shared-held"][:3] == [1, 0, 0] and p["flock"] == "held"
    assert src == before and kid == before


FIFOS = r"""
os.makedirs("/work/ff", exist_ok=True)
for name in ("rw", "wo", "gone"):
    os.mkfifo(f"/work/ff/{name}", 0o640)
fds = {}
fds["rw"] = os.open("/work/ff/rw", os.O_RDWR)  # no other peer
os.write(fds["rw"], b"kept")
helper = os.open("/work/ff/wo", os.O_RDWR | os.O_NONBLOCK)
fds["wo"] = os.open("/work/ff/wo", os.O_WRONLY | os.O_NONBLOCK)  # write-only, its reader gone
os.write(fds["wo"], b"queued")
os.close(helper)
fds["gone"] = os.open("/work/ff/gone", os.O_RDWR | os.O_NONBLOCK)
os.write(fds["gone"], b"ghost")
os.unlink("/work/ff/gone")
def report():
    r = {k: fd_facts(fd) for k, fd in fds.items()}
    reader = os.open(f"/proc/self/fd/{fds['wo']}", os.O_RDONLY | os.O_NONBLOCK)
    r["wo-read"] = os.read(reader, 100).decode()
    os.close(reader)
    r["rw-read"] = os.read(fds["rw"], 100).decode()
    r["gone-read"] = os.read(fds["gone"], 100).decode()
    return r
serve(report)
"""


@pytest.mark.parametrize("how", HOWS)
def test_fifos_without_peers_and_unlinked(family, how):
    ws, pid = _start(family, FIFOS)
    kid = _fork(family, ws, how)
    src, child = _report(ws, pid), _report(kid, pid)
    assert src["wo-read"] == "queued" and src["rw-read"] == "kept" and src["gone-read"] == "ghost"
    assert src["gone"]["link"] == "/work/ff/gone (deleted)" and src["gone"]["mode"] == 0o640
    assert src["wo"]["fl"] & os.O_ACCMODE == os.O_WRONLY
    assert child == src
    for w in (ws, kid):
        assert w.run("test -e /work/ff/gone").exit_code == 1


RESIZED_PIPES = r"""
import fcntl, hashlib, termios
F_SETPIPE_SZ, F_GETPIPE_SZ = 1031, 1032
os.makedirs("/work/rp", exist_ok=True)
os.mkfifo("/work/rp/big")
big = os.open("/work/rp/big", os.O_RDWR | os.O_NONBLOCK)  # grown past 64 KiB, filled past it
fcntl.fcntl(big, F_SETPIPE_SZ, 1 << 20)
os.write(big, bytes(i * 13 % 251 for i in range(300000)))
small_r, small_w = os.pipe2(os.O_NONBLOCK)  # shrunk to one page, full
fcntl.fcntl(small_r, F_SETPIPE_SZ, 4096)
os.write(small_w, b"s" * 4096)
both_r, both_w = os.pipe2(os.O_NONBLOCK)  # only one end left, opened again both ways
both = os.open(f"/proc/self/fd/{both_r}", os.O_RDWR | os.O_NONBLOCK)
os.close(both_r), os.close(both_w)
os.write(both, b"b" * 1000)
def facts(rd, wr):
    size, queued = fcntl.fcntl(rd, F_GETPIPE_SZ), struct.unpack("i", fcntl.ioctl(rd, termios.FIONREAD, b"0000"))[0]
    data = b""
    while len(data) < queued:
        data += os.read(rd, queued - len(data))
    os.write(wr, data)  # back, for the next report
    return [size, queued, hashlib.sha1(data).hexdigest()]
def report():
    return {"big": facts(big, big), "small": facts(small_r, small_w), "both": facts(both, both)}
serve(report)
"""


@pytest.mark.parametrize("how", HOWS)
def test_resized_pipes_keep_their_size_and_every_queued_byte(family, how):
    before, src, kid, _ = _reports(family, RESIZED_PIPES, how)
    assert before["big"][:2] == [1 << 20, 300000] and before["small"][:2] == [4096, 4096]
    assert before["both"][1] == 1000
    assert src == before and kid == before


DELETED_DIRS = r"""
import shutil
os.makedirs("/work/dd/held", exist_ok=True)
os.makedirs("/work/dd/tree/a/b", exist_ok=True)
os.chmod("/work/dd/held", 0o711)
os.chown("/work/dd/held", 42, 43)
held = os.open("/work/dd/held", os.O_RDONLY | os.O_DIRECTORY)
deep = os.open("/work/dd/tree/a/f", os.O_RDWR | os.O_CREAT, 0o640)
os.write(deep, b"deep")
os.chdir("/work/dd/tree/a/b")
os.rmdir("/work/dd/held")
shutil.rmtree("/work/dd/tree")  # the working directory, and what it is in
def report():
    r = {"held": fd_facts(held), "held-list": os.listdir(held), "deep": fd_facts(deep),
         "deep-read": os.pread(deep, 10, 0).decode(),
         "cwd": os.readlink("/proc/self/cwd"), "cwd-mode": stat.S_IMODE(os.stat(".").st_mode),
         "cwd-nlink": os.stat(".").st_nlink}
    return r
serve(report)
"""


@pytest.mark.parametrize("how", HOWS)
def test_deleted_directories_held_open_and_as_working_directory(family, how):
    before, src, kid, child = _reports(family, DELETED_DIRS, how)
    assert before["held"]["link"] == "/work/dd/held (deleted)" and before["held"]["mode"] == 0o711
    assert (before["held"]["uid"], before["held"]["gid"]) == (42, 43)
    assert before["cwd"] == "/work/dd/tree/a/b (deleted)" and before["cwd-nlink"] == 0
    assert before["deep"]["link"] == "/work/dd/tree/a/f (deleted)" and before["deep-read"] == "deep"
    assert src == before and kid == before
    assert child.run("ls /work/dd").stdout == b""  # made again and removed


WITHOUT_DAC = r"""
import ctypes
os.makedirs("/work/locked/sub")
fds = {}
for name in ("locked/gone", "locked/sub/gone"):
    fds[name] = os.open(f"/work/{name}", os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o640)
    os.write(fds[name], name.encode())
    os.fchown(fds[name], 77, 78)
    os.unlink(f"/work/{name}")
fds["again"] = os.open(f"/proc/self/fd/{fds['locked/gone']}", os.O_RDONLY)  # one file, two opens
os.makedirs("/work/locked/dir")
os.chmod("/work/locked/dir", 0o751)
fds["locked/dir"] = os.open("/work/locked/dir", os.O_RDONLY | os.O_DIRECTORY)
os.symlink("somewhere", "/work/locked/link")
fds["locked/link"] = os.open("/work/locked/link", os.O_PATH | os.O_NOFOLLOW)
os.makedirs("/work/locked/cwd")
os.chdir("/work/locked/cwd")
os.mkfifo("/work/locked/fifo", 0o640)
fds["locked/fifo"] = os.open("/work/locked/fifo", os.O_RDWR | os.O_NONBLOCK)
os.write(fds["locked/fifo"], b"queued")
for name in ("dir", "link", "cwd", "fifo"):
    (os.rmdir if name in ("dir", "cwd") else os.unlink)(f"/work/locked/{name}")
os.rmdir("/work/locked/sub")
os.chown("/work/locked", 1234, 1234)  # root may write it no more, once it drops the caps below
# root without CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER in its effective set
# (a service's bounding of itself): it keeps what a stock kernel's fork needs (CAP_SYS_ADMIN,
# CAP_SYS_CHROOT), but its clone may not make a file in /work/locked: the trainer does
libc = ctypes.CDLL(None, use_errno=True)
head, data = struct.pack("Ii", 0x20080522, 0), ctypes.create_string_buffer(24)
assert libc.capget(head, data) == 0
eff, prm, inh, eff_hi, prm_hi, inh_hi = struct.unpack("6I", data.raw)
assert libc.capset(head, struct.pack("6I", eff & ~0xF, prm, inh, eff_hi, prm_hi, inh_hi)) == 0
def report():
    r = {k: fd_facts(fd) for k, fd in fds.items()}
    for k in ("locked/gone", "locked/sub/gone", "again"):
        r[k]["bytes"] = os.pread(fds[k], 100, 0).decode()
    r["link-to"] = os.readlink("", dir_fd=fds["locked/link"])
    r["fifo-read"] = os.read(fds["locked/fifo"], 100).decode()
    os.write(fds["locked/fifo"], r["fifo-read"].encode())  # back, for the next report
    r["cwd"] = os.readlink("/proc/self/cwd")
    r["again-same"] = os.fstat(fds["again"]).st_ino == os.fstat(fds["locked/gone"]).st_ino
    try:
        open("/work/locked/mine", "w")
        r["locked"] = "writable"
    except PermissionError:
        r["locked"] = "EACCES"
    return r
serve(report)
"""


@pytest.mark.parametrize("how", HOWS)
def test_deleted_files_dirs_fifos_and_cwd_of_a_process_that_may_not_write_their_directory(family, how):
    before, src, kid, child = _reports(family, WITHOUT_DAC, how)
    for name in ("locked/gone", "locked/sub/gone"):
        f = before[name]
        assert f["link"] == f"/work/{name} (deleted)" and f["bytes"] == name, f
        assert (f["mode"], f["uid"], f["gid"]) == (0o640, 77, 78) and f["fl"] & os.O_APPEND
    assert before["again"]["link"] == "/work/locked/gone (deleted)" and before["again-same"]
    assert before["locked/dir"]["link"] == "/work/locked/dir (deleted)" and before["locked/dir"]["mode"] == 0o751
    assert before["locked/link"]["link"] == "/work/locked/link (deleted)" and before["link-to"] == "somewhere"
    assert before["locked/fifo"]["link"] == "/work/locked/fifo (deleted)" and before["fifo-read"] == "queued"
    assert before["cwd"] == "/work/locked/cwd (deleted)" and before["locked"] == "EACCES"
    assert src == before and kid == before
    assert child.run("ls /work/locked").stdout == b""  # made again and removed


NAMESPACES = r"""
kinds = ("net", "uts", "ipc", "mnt", "pid", "user", "cgroup")
fds = {k: os.open(f"/proc/self/ns/{k}", os.O_RDONLY) for k in kinds}
fds["net-path"] = os.open("/proc/self/ns/net", os.O_PATH)
def report():
    r = {k: fd_facts(fd) for k, fd in fds.items()}
    for k, fd in fds.items():
        r[k]["own"] = os.readlink(f"/proc/self/fd/{fd}") == os.readlink(f"/proc/self/ns/{k.split('-')[0]}")
    return r
serve(report)
"""


@pytest.mark.parametrize("how", HOWS)
def test_namespace_descriptors_refer_to_the_childs_own(family, how):
    before, src, kid, _ = _reports(family, NAMESPACES, how)
    for r in (before, src, kid):
        assert all(f["own"] for f in r.values()), r
    assert {k: f["fl"] for k, f in kid.items()} == {k: f["fl"] for k, f in before.items()}
    assert kid["net"]["link"] != src["net"]["link"] and kid["user"]["link"] == src["user"]["link"]


REFUSED = {
    "foreign-namespace": (r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
mine = os.open("/proc/self/ns/uts", os.O_RDONLY)
assert libc.unshare(0x04000000) == 0  # CLONE_NEWUTS
held = os.open("/proc/self/ns/uts", os.O_RDONLY)
assert libc.setns(mine, 0x04000000) == 0
os.close(mine)
""", "uts namespace"),
    "deleted-dir-replaced": (r"""
os.makedirs("/work/x")
held = os.open("/work/x", os.O_RDONLY | os.O_DIRECTORY)
os.rmdir("/work/x")
os.makedirs("/work/x")
""", "deleted directory"),
    "memfd-posix-lock": (r"""
held = os.memfd_create("locked")
fcntl.lockf(held, fcntl.LOCK_EX)
""", "POSIX lock on a memfd"),
    "unlinked-fifo-replaced": (r"""
os.mkfifo("/tmp/ff")
held = os.open("/tmp/ff", os.O_RDWR)
os.unlink("/tmp/ff")
open("/tmp/ff", "w").close()
""", "unlinked fifo"),
    "packet-pipe": (r"""
_, held = os.pipe2(os.O_DIRECT)  # its write end: the read end reads as any
""", "packet-mode pipe end"),
    "signal-driven-io": (r"""
held, _ = os.pipe()
fcntl.fcntl(held, fcntl.F_SETOWN, os.getpid())
fcntl.fcntl(held, fcntl.F_SETFL, fcntl.fcntl(held, fcntl.F_GETFL) | os.O_ASYNC)
""", "signal-driven I/O"),
    "lease": (r"""
open("/tmp/leased", "w").close()
held = os.open("/tmp/leased", os.O_RDONLY)
fcntl.fcntl(held, fcntl.F_SETLEASE, fcntl.F_RDLCK)
""", "lease"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_at_plan_time_naming_process_fd_and_kind(family, case):
    setup, kind = REFUSED[case]
    ws, pid = _start(family, setup + "out('/tmp/held', str(held))\nserve(lambda: {})\n")
    held = int(ws.read_file("/tmp/held"))
    with pytest.raises(ForkError) as e:
        ws.fork(1)
    msg = str(e.value)
    assert f"process {pid} (python3) fd {held}" in msg and kind in msg, msg
    assert e.value.step == "plan"
    assert _report(ws, pid) == {}  # the program goes on, untouched
