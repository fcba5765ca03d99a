"""A sandbox workspace on Linux 6.1 (the guest's kernel), on a rootfs an ext4 image holds.

6.1's overlayfs refuses a detached layer, so the idmapped views of the rootfs's layers are
attached under the state directory (runtime/userns.py); its tmpfs cannot be idmapped, nor can
the guest's own root (an overlay on virtio-fs), hence the ext4 image. The same test runs on a
newer kernel (there the views stay detached unless forced)."""
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import bunshin
from bunshin import kerndat
from bunshin.errors import BunshinError
from bunshin.runtime import gc, userns

BUSYBOX = Path("/bin/busybox")  # static: runs in a root with nothing else
VICTIM = "echo up > /tmp/up; exec sleep 1000"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts an ext4 image")


@pytest.fixture
def ext4_root():
    """A busybox root on a loop-mounted ext4 image, with a file uid and gid 1000 own."""
    tmp = Path(tempfile.mkdtemp(prefix="bunshin-ext4-"))
    img, root = tmp / "root.img", tmp / "root"
    root.mkdir()
    subprocess.run(["truncate", "-s", "32M", str(img)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True)
    subprocess.run(["mount", "-o", "loop", str(img), str(root)], check=True)
    try:
        for d in ("bin", "etc", "tmp", "home/u", "proc", "dev", "sys"):
            (root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(root / "tmp", 0o1777)
        shutil.copyfile(BUSYBOX, root / "bin" / "busybox")
        os.chmod(root / "bin" / "busybox", 0o755)  # the host's copy may have lost its x bit
        for tool in ("sh", "cat", "stat", "sleep", "echo", "touch", "id", "test", "grep"):
            os.symlink("busybox", root / "bin" / tool)
        (root / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\nu:x:1000:1000::/home/u:/bin/sh\n")
        (root / "home" / "u" / "f").write_text("host\n")
        for p in (root / "home" / "u", root / "home" / "u" / "f"):
            os.chown(p, 1000, 1000)
        yield root
    finally:
        subprocess.run(["umount", str(root)], check=True)
        shutil.rmtree(tmp)


def _views() -> list[str]:
    top = str(userns.views_root()) + "/"
    return [ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines()
            if ln.split()[4].startswith(top)]


def _check(w) -> None:
    assert w.run("cat /proc/self/uid_map").stdout.split() == [b"0", str(userns.BASE).encode(),
                                                            str(userns.SIZE).encode()]
    assert w.run("stat -c '%u %g' /home/u/f /etc/passwd").stdout == b"1000 1000\n0 0\n"
    assert w.run("cat /tmp/up").stdout == b"up\n"  # the forked process's file, in every copy
    assert w.run("echo w > /home/u/g && stat -c %u /home/u/g").stdout == b"0\n"
    assert w.run("id -u").stdout == b"0\n"


def test_sandbox_on_ext4(ext4_root, monkeypatch):
    if os.uname().release.startswith("6.1."):
        assert not kerndat.get().overlayfs_detached_layer  # what makes the views attached
    else:
        monkeypatch.setattr(userns, "attach_views", True)
    ws = bunshin.Workspace.create(rootfs=str(ext4_root), isolation="sandbox")
    made = [ws]
    try:
        assert _views(), "no attached view"
        ws.spawn(["/bin/sh", "-c", VICTIM])
        deadline = time.monotonic() + 30
        while ws.run("test -e /tmp/up").exit_code:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        kid = ws.fork(1)[0]
        made.append(kid)
        with ws.snapshot() as tpl:
            made.append(tpl.fork(1)[0])
        for w in made:
            _check(w)
        print(f"kernel {os.uname().release}: views {_views()}; uid_map of a fork: "
              f"{made[-1].run('cat /proc/self/uid_map').stdout.decode().strip()}")
        assert (ext4_root / "home" / "u" / "f").read_text() == "host\n"
        assert not (ext4_root / "home" / "u" / "g").exists()
    finally:
        for w in reversed(made):
            w.close()
    assert not _views()
    assert not [r for r in gc.collect(dry_run=True) if r.startswith("idmap:")]


def test_unidmappable_rootfs_refused():
    """The guest's own root (the default rootfs) is an overlay on virtio-fs: not idmappable on
    6.1, which the error says."""
    if not os.uname().release.startswith("6.1."):
        pytest.skip("the guest's root only")
    with pytest.raises(BunshinError, match="idmapped mounts"):
        bunshin.Workspace.create(isolation="sandbox")
    assert not _views()
