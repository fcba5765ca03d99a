"""isolation="sandbox": a workspace in a user namespace of its own (runtime/userns.py).

Root inside has every capability of that namespace and none of the host's: what needs the
host's (a devtmpfs, a global sysctl, the clock) fails, from the workspace and from its forks,
and the host is checked unchanged. Files keep their owners: the rootfs's through idmapped
layers, the workspace's own (and what the trainer writes) shifted in its upper layer."""

from __future__ import annotations

import fcntl
import os
import shutil
import time

import pytest

import bunshin
from bunshin import sandbox
from bunshin import config
from bunshin.errors import BunshinError, ConfigError
from bunshin.runtime import userns
from conftest import fork_by

# What only the host's root may do, each tried from inside: (command, what proves the host unchanged)
ATTEMPTS = {
    "devtmpfs": "mkdir -p /mnt/d && mount -t devtmpfs none /mnt/d",
    "drop_caches": "echo 1 > /proc/sys/vm/drop_caches",
    "swappiness": "echo 17 > /proc/sys/vm/swappiness",
    "core_pattern": "echo '|/bin/false' > /proc/sys/kernel/core_pattern",
    "clock": "date -s 2031-01-01",
    # its own cgroup is the root of its cgroup namespace: it may mount it, not change it
    "cgroup limit": "mkdir -p /mnt/c && mount -t cgroup -o pids none /mnt/c && echo 5 > /mnt/c/pids.max",
    "cgroup move": "mkdir -p /mnt/f && mount -t cgroup -o freezer none /mnt/f && mkdir /mnt/f/out "
                   "&& echo $$ > /mnt/f/out/cgroup.procs",
    "cgroup v2": "mkdir -p /mnt/u && mount -t cgroup2 none /mnt/u && mkdir /mnt/u/out",
}


def _host(path: str) -> str:
    with open(path) as f:
        return f.read()


def _caps(w) -> str:
    return next(ln.split()[1] for ln in w.run("cat /proc/self/status").stdout.decode().splitlines()
                if ln.startswith("CapEff:"))


def _limit_files(w) -> dict[str, str]:
    """The workspace's cgroup limit files as the host reads them."""
    out = {}
    for procs in w.cgroup.procs_files():
        d = os.path.dirname(procs)
        for name in ("pids.max", "memory.max", "memory.limit_in_bytes"):
            if os.path.exists(f"{d}/{name}"):
                out[f"{d}/{name}"] = _host(f"{d}/{name}")
    assert out
    return out


def _check_sandboxed(w, source=None) -> None:
    """``w`` is in a shifted user namespace (its source's when given), root there with every
    capability, and each of ATTEMPTS fails leaving the host as it was."""
    uid_map = w.run("cat /proc/self/uid_map").stdout.decode().split()
    assert uid_map == ["0", str(userns.BASE), str(userns.SIZE)], uid_map
    ns = os.readlink(f"/proc/{w.init_pid}/ns/user")
    assert ns != os.readlink("/proc/self/ns/user")
    if source is not None:
        assert ns == os.readlink(f"/proc/{source.init_pid}/ns/user")
    # every capability but those the sandbox's defaults drop (bunshin.sandbox), over its own
    # namespaces only
    dropped = sum(1 << bit for bit, _ in sandbox.DROPPED_CAPS.values())
    assert int(_caps(w), 16) == ((1 << (int(_host("/proc/sys/kernel/cap_last_cap")) + 1)) - 1) & ~dropped
    before = {p: _host(p) for p in ("/proc/sys/vm/swappiness", "/proc/sys/kernel/core_pattern")}
    limits = _limit_files(w)
    for what, cmd in ATTEMPTS.items():
        r = w.run(cmd)
        assert r.exit_code != 0, (what, r)
    assert " /mnt/d " not in w.run("cat /proc/mounts").stdout.decode()
    # its cgroup namespace is rooted at its own cgroup
    assert w.run("grep -v ':/$' /proc/self/cgroup").stdout == b""
    assert {p: _host(p) for p in before} == before
    assert _limit_files(w) == limits
    assert time.gmtime().tm_year < 2031


def test_sandbox_has_no_host_power(no_leaks):
    with bunshin.Workspace.create(isolation="sandbox", pids_limit=100) as ws:
        assert ws.config.isolation == "sandbox"
        _check_sandboxed(ws)
        assert ws.run("id -u").stdout == b"0\n"


@pytest.mark.parametrize("path", ["ws_fork", "tpl_fork"])
def test_forks_share_the_sandbox(family, path):
    ws = bunshin.Workspace.create(isolation="sandbox")
    family.append(ws)
    ws.write_file("/t.py", "import time\nopen('/tmp/up', 'w').write('1')\nwhile True: time.sleep(1)\n")
    pid = ws.spawn(["python3", "/t.py"])
    while ws.run("test -e /tmp/up").exit_code:
        time.sleep(0.01)
    kid = fork_by(ws, path)
    family.append(kid)
    more = fork_by(ws, path)  # by then from the pool of the namespace (fork/nsmaker.py), if on
    family.append(more)
    assert kid.config.isolation == "sandbox"
    _check_sandboxed(more, source=ws)
    _check_sandboxed(kid, source=ws)
    _check_sandboxed(ws)
    # every namespace of the child is owned by the source's user namespace
    for w in (kid, more, ws):
        for kind in ("mnt", "pid", "net", "ipc", "uts", "cgroup"):
            assert _owner_ino(w.init_pid, kind) == os.stat(f"/proc/{ws.init_pid}/ns/user").st_ino, kind
    # the forked process runs on as root of the namespace, in the child and the source
    for w in (kid, ws):
        assert w.run(f"grep Uid: /proc/{pid}/status").stdout == b"Uid:\t0\t0\t0\t0\n"
        # the host's view of it: the namespace's root is the host's BASE
        assert f"Uid:\t{userns.BASE}\t" in w.read_file(f"/proc/{pid}/status").decode()


def _owner_ino(pid: int, kind: str) -> int:
    """Inode of the user namespace that owns namespace ``kind`` of ``pid`` (NS_GET_USERNS)."""
    fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY)
    try:
        owner = fcntl.ioctl(fd, 0xB701)
    finally:
        os.close(fd)
    try:
        return os.fstat(owner).st_ino
    finally:
        os.close(owner)


@pytest.fixture
def user_tree():
    """A directory of the host's system owned by uid and gid 1000, seen by the default rootfs."""
    d = f"/opt/bunshin-isolation-{os.getpid()}"
    os.mkdir(d)
    try:
        with open(f"{d}/f", "w") as f:
            f.write("host\n")
        os.chown(d, 1000, 1000)
        os.chown(f"{d}/f", 1000, 1000)
        yield d
    finally:
        shutil.rmtree(d)


def test_rootfs_owners_kept(family, user_tree):
    ws = bunshin.Workspace.create(isolation="sandbox")
    family.append(ws)
    as_user = "setpriv --reuid=1000 --regid=1000 --clear-groups"
    for w in (ws, fork_by(ws, "ws_fork"), fork_by(ws, "tpl_fork")):
        if w is not ws:
            family.append(w)
        assert w.run(f"stat -c '%u %g' {user_tree} {user_tree}/f").stdout == b"1000 1000\n1000 1000\n"
        assert w.run("stat -c %u /etc/passwd /usr/bin").stdout == b"0\n0\n"
        r = w.run(f"{as_user} sh -c 'echo {w.id} >> {user_tree}/f && touch {user_tree}/new'")
        assert r.ok, r
        assert w.run(f"stat -c '%u %g' {user_tree}/f {user_tree}/new").stdout == b"1000 1000\n1000 1000\n"
        assert w.read_file(f"{user_tree}/f") == f"host\n{w.id}\n".encode()
        assert not w.run(f"{as_user} touch /etc/nope").ok  # root's files stay root's
    assert _host(f"{user_tree}/f") == "host\n"  # copied up, the host's file untouched
    assert not os.path.exists(f"{user_tree}/new")


def test_file_owners_round_trip(no_leaks):
    with bunshin.Workspace.create(isolation="sandbox") as ws:
        ws.write_file("/root/deep/made.txt", "by the trainer")
        assert ws.run("stat -c '%u %g' /root/deep /root/deep/made.txt").stdout == b"0 0\n0 0\n"
        assert ws.run("cat /root/deep/made.txt").stdout == b"by the trainer"
        assert ws.run("echo more >> /root/deep/made.txt").ok  # root inside may write it
        assert ws.read_file("/root/deep/made.txt") == b"by the trainer" + b"more\n"
        upper = ws.body.dir.upper / "root" / "deep" / "made.txt"
        st = os.stat(upper)
        assert (st.st_uid, st.st_gid) == (userns.BASE, userns.BASE)
        # a file a user inside owns keeps that owner when the trainer rewrites it
        assert ws.run("install -o 1000 -g 1000 /dev/null /tmp/u").ok
        ws.write_file("/tmp/u", "again")
        assert ws.run("stat -c '%u %g' /tmp/u").stdout == b"1000 1000\n"
        assert os.stat(ws.body.dir.upper / "tmp" / "u").st_uid == userns.BASE + 1000


def test_default_is_the_sandbox(no_leaks, monkeypatch):
    """A workspace created without isolation, and its fork, show no host-wide power: the uid
    map is not the host's, the user namespace not the trainer's, a devtmpfs is refused."""
    monkeypatch.delenv("BUNSHIN_ISOLATION", raising=False)
    with bunshin.Workspace.create() as ws:
        assert ws.config.isolation == "sandbox"
        host_map = _host("/proc/self/uid_map")
        for w in (ws, *ws.fork(1)):
            try:
                assert w.run("cat /proc/self/uid_map").stdout.decode().split() != host_map.split()
                ns = w.run("readlink /proc/self/ns/user").stdout.decode().strip()
                assert ns and ns != os.readlink("/proc/self/ns/user")
                assert not w.run("mkdir -p /mnt/d && mount -t devtmpfs none /mnt/d").ok
            finally:
                if w is not ws:
                    w.close()


def test_trusted_is_the_host(no_leaks):
    with bunshin.Workspace.create(isolation="trusted") as ws:
        assert ws.config.isolation == "trusted"
        assert os.readlink(f"/proc/{ws.init_pid}/ns/user") == os.readlink("/proc/self/ns/user")
        assert ws.run("cat /proc/self/uid_map").stdout.split()[:2] == [b"0", b"0"]


def test_bad_isolation_refused(no_leaks):
    with pytest.raises(bunshin.IsolationError, match="'trusted', 'sandbox'") as e:
        bunshin.Workspace.create(isolation="strict")
    assert isinstance(e.value, BunshinError)


def test_isolation_knob(monkeypatch):
    monkeypatch.setenv("BUNSHIN_ISOLATION", "sandbox")
    assert config.isolation() == "sandbox"
    monkeypatch.setenv("BUNSHIN_ISOLATION", "trusted")
    assert config.isolation() == "trusted"
    monkeypatch.setenv("BUNSHIN_ISOLATION", "")
    assert config.isolation() == "sandbox"
    monkeypatch.setenv("BUNSHIN_ISOLATION", "open")
    with pytest.raises(ConfigError, match="BUNSHIN_ISOLATION"):
        config.isolation()


def _attached_views() -> list[str]:
    """Mount points of attached idmapped views (and their directories) in our mount table."""
    top = str(userns.views_root()) + "/"
    return [ln.split()[4] for ln in _host("/proc/self/mountinfo").splitlines()
            if ln.split()[4].startswith(top)]


@pytest.mark.parametrize("path", ["ws_fork", "tpl_fork"])
def test_attached_views(family, user_tree, monkeypatch, path):
    """The views attached under the state directory (what 6.1 needs, forced here): the
    sandbox, its fork and the files' owners are as with detached views, the views propagate
    nowhere, and closing the last workspace of the namespace unmounts and removes them."""
    monkeypatch.setattr(userns, "attach_views", True)
    ws = bunshin.Workspace.create(isolation="sandbox")
    family.append(ws)
    ino = os.stat(f"/proc/{ws.init_pid}/ns/user").st_ino
    mine = [m for m in _attached_views() if m.endswith(f"-{ino}") or f"-{ino}/" in m]
    assert len(mine) == 2, mine  # the views' directory and the host's root, the one layer
    top = next(m for m in mine if m.endswith(f"-{ino}"))
    assert next(ln for ln in _host("/proc/self/mountinfo").splitlines()
                if ln.split()[4] == top).split()[6:7] == ["unbindable"]
    kid = fork_by(ws, path)
    family.append(kid)
    _check_sandboxed(kid, source=ws)
    for w in (ws, kid):
        assert w.run("cat /proc/self/uid_map").stdout.decode().split() == ["0", str(userns.BASE),
                                                                          str(userns.SIZE)]
        assert w.run(f"stat -c '%u %g' {user_tree}/f /etc/passwd").stdout == b"1000 1000\n0 0\n"
        assert w.run(f"grep -c ' {userns.views_root()}' /proc/self/mountinfo").stdout == b"0\n"
    assert not ws.run("touch /etc/host-file-of-root && "
                      "setpriv --reuid=1000 --regid=1000 --clear-groups touch /etc/nope").ok
    kid.close()
    assert len([m for m in _attached_views() if f"-{ino}" in m]) == 2  # the source still runs
    ws.close()
    assert not [m for m in _attached_views() if f"-{ino}" in m]
    assert not os.path.exists(top)


def test_gc_removes_dead_trainers_views(no_leaks, monkeypatch):
    """Views attached by a trainer that died without closing its workspace: `bunshin gc`
    unmounts and removes them (the trainer here: a forked child, killed)."""
    import signal

    from bunshin.runtime import gc

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            userns.attach_views = True
            ws = bunshin.Workspace.create(isolation="sandbox")
            os.write(w, str(os.stat(f"/proc/{ws.init_pid}/ns/user").st_ino).encode())
            time.sleep(60)
        finally:
            os._exit(1)
    os.close(w)
    try:
        ino = int(os.read(r, 64))
    finally:
        os.close(r)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    top = next(m for m in _attached_views() if m.endswith(f"-{ino}"))
    assert os.path.basename(top).startswith(f"{pid}-")
    removed = gc.collect()
    assert f"idmap:{os.path.basename(top)}" in removed, removed
    assert not [m for m in _attached_views() if f"-{ino}" in m]
    assert not os.path.exists(top)
