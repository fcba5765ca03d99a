"""What a fork cannot carry of files and memory shared with something outside the process is
refused up front (ForkError naming the process and the object), and the source runs on
unchanged: a shared mapping of an object no file names (an AIO ring), a shared mapping of a
deleted file no descriptor holds, a SysV segment attached in part, a unix socket bound to a
path another file has taken since."""

from __future__ import annotations

import pytest

from bunshin.errors import ForkError

from conftest import fork_by, start_script

AIO_RING = """
import ctypes
ctx = ctypes.c_ulong(0)
assert ctypes.CDLL(None, use_errno=True).syscall(206, 8, ctypes.byref(ctx)) == 0  # io_setup
out('/tmp/ready', 'ok')
time.sleep(1000)
"""

DELETED_UNHELD = """
import ctypes, mmap
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
fd = os.open('/tmp/mapped', os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 4096)
assert libc.mmap(None, 4096, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0) not in (None, 2**64 - 1)
os.close(fd)
os.unlink('/tmp/mapped')
out('/tmp/ready', 'ok')
time.sleep(1000)
"""


@pytest.mark.parametrize("path", ["ws_fork", "tpl_fork"])
@pytest.mark.parametrize("script,said", [(AIO_RING, "/[aio]"), (DELETED_UNHELD, "deleted file /tmp/mapped")],
                         ids=["aio-ring", "deleted-unheld"])
def test_shared_mapping_refused(family, script, said, path):
    ws = start_script(family, script, "/tmp/ready")
    with pytest.raises(ForkError, match="shared mapping") as e:
        fork_by(ws, path)
    assert said in str(e.value) and "python3" in str(e.value)
    assert ws.run("cat /tmp/ready").stdout == b"ok"  # the source runs on


SYSV_PART = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
shmid = libc.shmget(0, 3 * 4096, 0o1600)
addr = libc.shmat(shmid, None, 0)
assert libc.munmap(ctypes.c_void_p(addr + 2 * 4096), 4096) == 0
out('/tmp/ready', 'ok')
time.sleep(1000)
"""


@pytest.mark.parametrize("path", ["ws_fork", "tpl_fork"])
def test_sysv_attachment_in_part_refused(family, path):
    ws = start_script(family, SYSV_PART, "/tmp/ready")
    with pytest.raises(ForkError, match="attached at 0x[0-9a-f]+ only in part") as e:
        fork_by(ws, path)
    assert "python3" in str(e.value)
    assert ws.run("cat /tmp/ready").stdout == b"ok"


NAME_TAKEN = """
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind('/tmp/s.sock')
s.listen()
os.unlink('/tmp/s.sock')
out('/tmp/s.sock', 'another file')
out('/tmp/ready', 'ok')
time.sleep(1000)
"""


@pytest.mark.parametrize("path", ["ws_fork", "tpl_fork"])
def test_unix_socket_name_taken_refused(family, path):
    ws = start_script(family, NAME_TAKEN, "/tmp/ready")
    with pytest.raises(ForkError, match="bound to /tmp/s.sock, where another file is now") as e:
        fork_by(ws, path)
    assert "python3" in str(e.value) and "fd " in str(e.value)
    assert ws.read_file("/tmp/s.sock") == b"another file"
