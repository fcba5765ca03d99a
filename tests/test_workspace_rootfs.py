"""Workspaces on every kind of rootfs, with real programs running in them."""

from __future__ import annotations

import subprocess

import pytest

import bunshin
from test_rootfs import busybox_root, image_layers, make_oci_layout


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BUNSHIN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_tar_rootfs_workspace(no_leaks, cache, tmp_path):
    archive = busybox_root().write(tmp_path / "root.tar.gz", "gz")
    with bunshin.Workspace.create(rootfs=archive) as ws:
        r = ws.run("cat /etc/hostname; ls /home/alice; echo $0")
        assert r.stdout == b"tiny\nnotes\n/bin/sh\n"  # busybox sh: the root has no bash
        sh_r = ws.exec(["/bin/busybox", "stat", "-c", "%a %u", "/usr/bin/su"])
        assert sh_r.stdout == b"4755 0\n"
        ws.write_file("/tmp/x", b"y")
        assert ws.run("cat /tmp/x").stdout == b"y"
        assert ws.run("bash -c true").exit_code == 127


def test_oci_rootfs_workspace_applies_whiteouts(no_leaks, cache, tmp_path):
    layout = tmp_path / "oci"
    make_oci_layout(layout, image_layers())
    with bunshin.Workspace.create(rootfs=layout) as ws:
        r = ws.run("cat /etc/issue; test -e /etc/motd || echo no-motd; ls /srv/data")
        assert r.stdout == b"layer two\nno-motd\nnew\n"
        ws.run("echo changed > /etc/issue")
        assert ws.read_file("/etc/issue") == b"changed\n"
    # the image's layers are never written
    with bunshin.Workspace.create(rootfs=layout) as ws2:
        assert ws2.read_file("/etc/issue") == b"layer two\n"


def test_directory_rootfs_workspace(no_leaks, cache, tmp_path):
    root = tmp_path / "dir-root"
    archive = busybox_root().write(tmp_path / "r.tar")
    root.mkdir()
    # GNU tar, not tarfile: tarfile lets a hard link's mode rewrite its target's
    subprocess.run(["tar", "-C", str(root), "-xpf", str(archive)], check=True, capture_output=True)
    with bunshin.Workspace.create(rootfs=root) as ws:
        ws.run("echo new > /etc/new; rm /etc/hostname")
        assert ws.run("cat /etc/new; ls /etc").stdout == b"new\nnew\npasswd\n"
    assert (root / "etc" / "hostname").exists() and not (root / "etc" / "new").exists()


@pytest.mark.slow
@pytest.mark.network
def test_debian_rootfs_workspace(no_leaks):
    with bunshin.Workspace.create(rootfs="debian:bookworm") as ws:
        r = ws.run(". /etc/os-release; echo $VERSION_CODENAME; command -v bash")
        assert r.stdout == b"bookworm\n/usr/bin/bash\n"
