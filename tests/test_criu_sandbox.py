"""CRIU dump and restore of sandbox workspaces (``isolation="sandbox"``): the restored
workspace, its forks and a loaded template's forks run in a user namespace with the same maps,
with the sandbox's defaults in force (seccomp filter, capability sets, masked and read-only
/proc and /sys, a cgroup namespace owned by it), and what CRIU cannot carry is refused by name.
tests/test_criu_sandbox_escape.py runs every escape attempt from them."""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path

import pytest

import bunshin
from bunshin.errors import CheckpointError, CriuError

try:
    from bunshin.criu import runner as _runner

    _runner.criu()
except CriuError as e:  # no CRIU >= 4 here: say why, run nothing
    pytest.skip(f"no usable CRIU >= 4 ({e}); `python3 -m bunshin criu provision` installs one",
                allow_module_level=True)

from conftest import wait_file, ws_status

from bunshin import criu
from bunshin.runtime.userns import BASE, SIZE

_NS_GET_USERNS = 0xB701
RUN_AS_1001 = ("setpriv", "--reuid=1001", "--regid=1001", "--clear-groups")


def _sandbox(**kw) -> bunshin.Workspace:
    return bunshin.Workspace.create(isolation="sandbox", **kw)


def _defaults(w) -> dict:
    """What a workspace shows of its sandbox, read inside: its id maps, capability sets,
    seccomp filters and the mounts of its /proc, /sys and /dev (point, root in its file
    system, type, mount options; their ids and order are CRIU's)."""
    status = w.run("cat /proc/self/status").stdout.decode()
    keep = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp",
            "Seccomp_filters")
    mounts = set()
    for line in w.run("cat /proc/1/mountinfo").stdout.decode().splitlines():
        f = line.split()
        fstype = f[f.index("-") + 1]
        if f[4] != "/":  # the root's options name its layers, which a restore copies
            mounts.add((f[4], f[3], fstype, f[5]))
    return {"uid_map": w.run("cat /proc/self/uid_map").stdout.split(),
            "gid_map": w.run("cat /proc/self/gid_map").stdout.split(),
            "status": [ln for ln in status.splitlines() if ln.split(":")[0] in keep],
            "mounts": mounts}


def _ns(pid: int, kind: str) -> int:
    return os.stat(f"/proc/{pid}/ns/{kind}").st_ino


def _owner(pid: int, kind: str) -> int:
    """The inode of the user namespace that owns ``pid``'s ``kind`` namespace."""
    fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        owner = fcntl.ioctl(fd, _NS_GET_USERNS)
        try:
            return os.fstat(owner).st_ino
        finally:
            os.close(owner)
    finally:
        os.close(fd)


def _check_sandboxed(w, want: dict) -> None:
    """``w`` has the sandbox's defaults ``want`` (a source's _defaults), in a user namespace of
    its own (not the trainer's) that owns its other namespaces, checked from the host."""
    assert _defaults(w) == want
    assert want["uid_map"] == [b"0", str(BASE).encode(), str(SIZE).encode()]
    pid = w.init_pid
    assert _ns(pid, "user") != _ns(os.getpid(), "user")
    for kind in ("mnt", "pid", "net", "ipc", "uts", "cgroup"):
        assert _ns(pid, kind) != _ns(os.getpid(), kind), kind
        assert _owner(pid, kind) == _ns(pid, "user"), kind
    # the cgroup namespace is rooted at the workspace's own group
    assert all(ln.endswith(":/") for ln in w.run("cat /proc/self/cgroup").stdout.decode().splitlines())


def test_a_restored_sandbox_keeps_its_maps_defaults_owners_and_processes(family, tmp_path):
    ws = _sandbox(pids_limit=128)
    family.append(ws)
    sh = ws.shell()
    sh.run("cd /tmp && X=42")
    ws.run("mkdir -p /home/user && echo mine > /home/user/f && chown -R 1000:1000 /home/user")
    other = ws.spawn([*RUN_AS_1001, "sh", "-c", "echo 1001 > /tmp/by-1001; exec sleep 100000"])
    wait_file(ws, "/tmp/by-1001")
    want = _defaults(ws)
    owners = ws.run("stat -c '%n %u:%g' /home/user/f /tmp/by-1001 /etc/shadow /etc/passwd").stdout
    criu.dump_workspace(ws, tmp_path / "img")
    assert criu.read_meta(tmp_path / "img")["config"]["isolation"] == "sandbox"
    w = criu.restore_workspace(tmp_path / "img")
    family.append(w)
    _check_sandboxed(w, want)
    assert _ns(w.init_pid, "user") != _ns(ws.init_pid, "user")  # a user namespace of its own
    assert w.run("stat -c '%n %u:%g' /home/user/f /tmp/by-1001 /etc/shadow /etc/passwd").stdout == owners
    assert ws_status(w, other, "Uid") == "1001\t1001\t1001\t1001"
    # files of other uids keep working, for their owners and for root inside
    r = w.run("setpriv --reuid=1000 --regid=1000 --clear-groups sh -c 'echo more >> /home/user/f' "
              "&& cat /home/user/f && stat -c %u:%g /home/user/f")
    assert r.stdout == b"mine\nmore\n1000:1000\n", r
    assert w.shells[0].run("echo $X $PWD").stdout == b"42 /tmp\n"
    # the source ran on, unchanged
    assert _defaults(ws) == want and sh.run("echo $X").stdout == b"42\n"
    assert ws.read_file("/home/user/f") == b"mine\n"


def test_forks_of_a_restored_sandbox_share_its_user_namespace(family, tmp_path):
    ws = _sandbox()
    family.append(ws)
    ws.shell().run("Y=kept")
    ws.spawn(["python3", "-c", "import threading, time\n"
              "threading.Thread(target=time.sleep, args=(100000,)).start(); time.sleep(100000)"])
    want = _defaults(ws)
    criu.dump_workspace(ws, tmp_path / "img")
    w = criu.restore_workspace(tmp_path / "img")
    family.append(w)
    (kid,) = w.fork(1)
    family.append(kid)
    with w.snapshot() as tpl:
        kids = tpl.fork(2)
    family.extend(kids)
    for k in (kid, *kids):
        _check_sandboxed(k, want)
        assert _ns(k.init_pid, "user") == _ns(w.init_pid, "user")
        assert k.shells[0].run("echo $Y").stdout == b"kept\n"
        assert sorted(p.cmdline[0] for p in k.processes()) == sorted(p.cmdline[0] for p in ws.processes())
    assert bunshin.memory.family_usage(kids).shared_bytes > 1 << 20  # the template's memory, shared


def test_a_sandbox_template_saved_and_loaded_forks_in_a_sandbox(family, tmp_path):
    ws = _sandbox()
    family.append(ws)
    ws.shell().run("Z=saved")
    ws.write_file("/data/f", "in the upper layer\n")
    want = _defaults(ws)
    with ws.snapshot() as tpl:
        tpl.save(tmp_path / "tpl")
    loaded = bunshin.Template.load(tmp_path / "tpl")
    try:
        kids = loaded.fork(2)
    finally:
        loaded.close()
    family.extend(kids)
    assert _ns(kids[0].init_pid, "user") == _ns(kids[1].init_pid, "user") != _ns(ws.init_pid, "user")
    for k in kids:
        _check_sandboxed(k, want)
        assert k.shells[0].run("echo $Z").stdout == b"saved\n"
        assert k.read_file("/data/f") == b"in the upper layer\n"
    # a loaded sandbox template's child is saved again, and restores as a sandbox
    criu.dump_workspace(kids[0], tmp_path / "again")
    again = criu.restore_workspace(tmp_path / "again")
    family.append(again)
    _check_sandboxed(again, want)


def test_a_process_in_a_nested_user_namespace_is_refused_by_name(family, tmp_path):
    ws = _sandbox()
    family.append(ws)
    ws.spawn(["unshare", "--user", "--map-root-user", "sh", "-c", "touch /tmp/in; exec sleep 100000"])
    wait_file(ws, "/tmp/in")
    with pytest.raises(CheckpointError, match=r"process \d+ \(sleep\) is in a user namespace of "
                                              r"its own, nested in the workspace's"):
        criu.dump_workspace(ws, tmp_path / "img")
    assert not (tmp_path / "img").exists()
    assert ws.run("echo alive").stdout == b"alive\n"


def test_a_sandbox_at_the_nesting_limit_goes_back_to_the_top(family):
    """The rebase (a CRIU dump and restore into the same object, docs/design.md) of a sandbox:
    it comes back in a user namespace of its own with its defaults, and forks on."""
    ws = _sandbox()
    family.append(ws)
    sh = ws.shell()
    sh.run("V=deep")
    want = _defaults(ws)
    levels = []
    for _ in range(34):
        ws.adopt(ws.fork(1)[0])  # the workspace becomes its fork: one level deeper
        levels.append(len(Path(f"/proc/{ws.init_pid}/status").read_text()
                          .split("NSpid:")[1].splitlines()[0].split()) - 1)
    assert max(levels) == 32 and levels[-1] < 32, levels
    _check_sandboxed(ws, want)
    assert sh.run("echo $V").stdout == b"deep\n"


def _passing_group(hierarchy: str) -> Path | None:
    """A new, empty group at the root of the host's ``hierarchy`` (a cgroup v1 controller's
    directory under /sys/fs/cgroup): the kind podman's and kerndat's probes make and remove."""
    top = Path("/sys/fs/cgroup") / hierarchy
    if not (top / "cgroup.procs").exists():
        return None
    g = top / f"bunshin-test-passing-{os.getpid()}"
    g.mkdir()
    return g


@pytest.mark.parametrize("isolation", ["sandbox", "trusted"])
def test_a_host_group_gone_between_dump_and_restore_does_not_matter(family, tmp_path, isolation):
    ws = bunshin.Workspace.create(isolation=isolation)
    family.append(ws)
    ws.shell().run("X=7")
    g = _passing_group("blkio")  # a hierarchy the workspace has no group of its own in
    if g is None:
        pytest.skip("no cgroup v1 blkio hierarchy at /sys/fs/cgroup/blkio")
    try:
        criu.dump_workspace(ws, tmp_path / "img")
    finally:
        g.rmdir()
    w = criu.restore_workspace(tmp_path / "img")
    family.append(w)
    assert w.shells[0].run("echo $X").stdout == b"7\n"
    assert w.run("echo $((6*7))").stdout == b"42\n"
