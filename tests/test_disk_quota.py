"""A workspace's disk quota (``disk_limit``, runtime/quota.py): writing past it fails with
EDQUOT inside, in a created workspace and in each fork separately (counted from the fork on),
under either isolation, while the trainer's state directory and other workspaces go on
writing; what a closed workspace wrote is given back. The state image Bunshin mounts gets
quotas (also one made without them) and leaves the host's disk a reserve."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import time
from pathlib import Path

import pytest

import bunshin
from bunshin.errors import LimitError
from bunshin.runtime import quota, statefs

LIMIT = 64 << 20
BTRFS_IOC_SYNC = 0x9408  # _IO(0x94, 8): commit the transaction

# writes 1 MiB at a time until a write fails; prints bytes written and the errno (0: none)
FILL = """
import os, sys
path, most = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
n, err, chunk = 0, 0, b"x" * (1 << 20)
try:
    while n < most:
        n += os.write(fd, chunk)
    os.fsync(fd)
except OSError as e:
    err = e.errno
print(n, err)
"""

pytestmark = pytest.mark.skipif(not quota.supported(), reason="no btrfs simple quotas (Linux < 6.7)")


def _fill(w, path: str = "/fill", most: int = 4 * LIMIT) -> tuple[int, int]:
    r = w.exec(["python3", "-c", FILL, path, str(most)], timeout=60)
    assert r.exit_code == 0, r.stderr
    n, err = map(int, r.stdout.split())
    return n, err


def _stopped_at_limit(w) -> int:
    n, err = _fill(w)
    assert err == errno.EDQUOT, (n, err)
    assert LIMIT - (8 << 20) <= n <= LIMIT, n
    return n


def _host_writes(directory: Path) -> None:
    f = directory / f"probe-{os.getpid()}"
    try:
        with open(f, "wb") as fh:
            fh.write(b"y" * (1 << 20))
            os.fsync(fh.fileno())
    finally:
        f.unlink(missing_ok=True)


def _commit(state: Path) -> None:
    fd = os.open(state, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, BTRFS_IOC_SYNC)
    finally:
        os.close(fd)


def _used(state: Path) -> int:
    st = os.statvfs(state)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@pytest.mark.parametrize("isolation", ["trusted", "sandbox"])
def test_each_workspace_and_fork_stops_at_its_own_quota(no_leaks, isolation):
    state = statefs.ensure()
    before = _used(state)
    made = [bunshin.Workspace.create(isolation=isolation, disk_limit="64M")]
    try:
        ws = made[0]
        assert ws.config.disk_limit == LIMIT
        ws.write_file("/kept", b"k" * (16 << 20))  # before the forks: the source's, not theirs
        made += ws.fork(1)
        with ws.snapshot() as tpl:
            made += tpl.fork(1)
        other = bunshin.Workspace.create(isolation=isolation, disk_limit="64M")
        made.append(other)
        for w in made[1:3]:
            assert w.config.disk_limit == LIMIT
            assert w.run("wc -c < /kept").stdout == b"16777216\n"
        _, err = _fill(ws)
        assert err == errno.EDQUOT
        for w in made[1:3]:  # each fork writes its full limit, whatever its source wrote
            _stopped_at_limit(w)
        _host_writes(state)
        assert other.run("head -c 32M /dev/zero > /w && rm /w").exit_code == 0
        assert ws.run("rm /fill && head -c 8M /dev/zero > /w").exit_code == 0  # room again
        assert made[1].run("wc -c < /kept").stdout == b"16777216\n"
    finally:
        for w in reversed(made):
            w.close()
    # btrfs drops deleted subvolumes in the background, woken by a commit (every 30 s, or
    # this sync's)
    deadline = time.monotonic() + 10
    while _used(state) > before + (16 << 20) and time.monotonic() < deadline:
        _commit(state)
        time.sleep(0.1)
    assert _used(state) <= before + (16 << 20), (before, _used(state))


def test_no_limit_and_bad_limits(no_leaks, monkeypatch):
    with pytest.raises(LimitError):
        bunshin.Workspace.create(disk_limit="lots")
    with pytest.raises(LimitError):
        bunshin.Workspace.create(disk_limit=-1)
    monkeypatch.setenv("BUNSHIN_DISK_LIMIT", "32M")
    with bunshin.Workspace.create() as ws:
        assert ws.config.disk_limit == 32 << 20
        n, err = _fill(ws, most=128 << 20)
        assert err == errno.EDQUOT and n <= 32 << 20
    with bunshin.Workspace.create(disk_limit=0) as ws:
        assert ws.config.disk_limit is None
        assert _fill(ws, most=96 << 20) == (96 << 20, 0)


def test_zero_as_a_string_is_no_limit_and_a_small_limit_names_0(no_leaks):
    # None takes BUNSHIN_DISK_LIMIT (4G by default): the messages name 0 for no limit
    with bunshin.Workspace.create(disk_limit="0") as ws:
        assert ws.config.disk_limit is None
    for bad in ("1M", 1 << 20, "lots", 1 << 64):
        with pytest.raises(LimitError) as e:
            bunshin.Workspace.create(disk_limit=bad)
        assert "0 for no limit" in str(e.value) and "None" not in str(e.value), e.value


@pytest.fixture
def own_state(tmp_path, monkeypatch):
    """A state directory of this test's own, its image made and mounted as an older Bunshin
    did: without quotas."""
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("BUNSHIN_STATE_DIR", str(state))
    img = statefs.image_path(state)
    subprocess.run(["truncate", "-s", "256G", str(img)], check=True)
    subprocess.run(statefs._mkfs(str(img)), check=True, capture_output=True)
    subprocess.run(["mount", "-o", "loop,noatime", str(img), str(state)], check=True)
    yield state
    subprocess.run(["umount", str(state)], capture_output=True)


def test_an_image_without_quotas_gets_them_and_leaves_the_host_a_reserve(own_state):
    assert quota.mode(own_state) == "disabled"
    assert statefs.ensure() == own_state
    assert quota.mode(own_state) == "squota"
    host = os.statvfs(own_state.parent)
    fs = os.statvfs(own_state)
    img = os.stat(statefs.image_path(own_state))
    # what the image can still take of the host is less than the host has free
    assert fs.f_blocks * fs.f_frsize < img.st_blocks * 512 + host.f_bavail * host.f_frsize
    assert fs.f_blocks * fs.f_frsize < img.st_size


def test_doctor_names_the_quota(no_leaks):
    from bunshin import doctor

    (row,) = [c for c in doctor.quota_checks() if c.name == "disk quotas"]
    assert row.ok and "simple quotas" in row.detail


def test_a_full_workspace_still_runs_forks_and_closes(no_leaks):
    with bunshin.Workspace.create(disk_limit="64M") as ws:
        _stopped_at_limit(ws)
        assert ws.run("echo alive").stdout == b"alive\n"
        with pytest.raises(Exception) as e:  # the trainer's writes are bounded too
            ws.write_file("/more", b"m" * (8 << 20))
        assert "quota" in str(e.value).lower(), e.value
        (kid,) = ws.fork(1)
        with kid:
            assert kid.run("wc -c < /fill").stdout.strip() == ws.run("wc -c < /fill").stdout.strip()
            assert kid.run("head -c 32M /dev/zero > /w && rm /w").exit_code == 0


@pytest.fixture
def small_host(tmp_path, monkeypatch):
    """A state directory on a host file system of 2.3 GiB of its own (an ext4 image)."""
    host = tmp_path / "host"
    host.mkdir()
    img = tmp_path / "host.img"
    subprocess.run(["truncate", "-s", "2300M", str(img)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True)
    subprocess.run(["mount", "-o", "loop", str(img), str(host)], check=True)
    monkeypatch.setenv("BUNSHIN_STATE_DIR", str(host / "state"))
    try:
        yield host
    finally:
        statefs.release()
        subprocess.run(["umount", str(host / "state")], capture_output=True)
        for _ in range(50):  # the state image's loop device lets go of it in the background
            if subprocess.run(["umount", str(host)], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)


def test_workspaces_together_leave_the_trainer_and_the_host_room(small_host, no_leaks):
    """On a host with 2.2 GiB free the state file system is sized to ~1 GiB; a workspace with
    no limit of its own stops at what all workspaces may write together, before the state file
    system or the host is full, and the trainer's state directory takes files still."""
    state = statefs.ensure()
    size = os.statvfs(state).f_blocks * os.statvfs(state).f_frsize
    assert size < 1100 << 20  # the host's 2.2 GiB free less its 1 GiB reserve
    with bunshin.Workspace.create(disk_limit=0) as ws:
        n, err = _fill(ws, most=2 << 30)
        assert err == errno.EDQUOT and n <= size // 2 + (1 << 20), (n, size)
        _host_writes(state)  # the trainer's state directory
    host = os.statvfs(small_host)
    assert host.f_bavail * host.f_frsize >= 900 << 20
    deadline = time.monotonic() + 10  # the closed workspace's space back
    while os.statvfs(state).f_bavail * os.statvfs(state).f_frsize < size // 2:
        assert time.monotonic() < deadline
        _commit(state)
        time.sleep(0.1)
    with bunshin.Workspace.create() as other:  # room again: one starts, writes, forks
        assert other.run("head -c 64M /dev/zero > /w && echo written").stdout == b"written\n"
        (kid,) = other.fork(1)
        kid.close()


def test_a_restored_workspace_keeps_its_limit(no_leaks, tmp_path):
    from bunshin import criu

    try:
        criu.runner.criu()
    except bunshin.BunshinError as e:
        pytest.skip(f"no usable CRIU: {e}")
    with bunshin.Workspace.create(disk_limit="64M") as ws:
        criu.dump_workspace(ws, tmp_path / "img")
    with criu.restore_workspace(tmp_path / "img") as back:
        assert back.config.disk_limit == LIMIT
        _stopped_at_limit(back)


def test_a_file_system_without_quotas_gets_no_quota_calls(tmp_path, monkeypatch, no_leaks):
    """A btrfs of the user's own without quotas: a workspace with a limit starts, unbounded,
    and its layer costs no quota ioctl (each would fail)."""
    state = tmp_path / "state"
    state.mkdir()
    img = tmp_path / "own.img"
    subprocess.run(["truncate", "-s", "2G", str(img)], check=True)
    subprocess.run(["mkfs.btrfs", "-q", "-f", str(img)], check=True, capture_output=True)
    subprocess.run(["mount", "-o", "loop", str(img), str(state)], check=True)
    monkeypatch.setenv("BUNSHIN_STATE_DIR", str(state))
    calls = []
    real = quota.ioctl
    monkeypatch.setattr(quota, "ioctl", lambda *a: (calls.append(a), real(*a))[1])
    try:
        assert statefs.ensure() == state and quota.mode(state) == "disabled"
        with bunshin.Workspace.create(disk_limit="64M") as ws:
            assert ws.run("echo alive").stdout == b"alive\n"
        assert calls == []
    finally:
        subprocess.run(["umount", str(state)], capture_output=True)
