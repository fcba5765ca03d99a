"""Bunshin's CRIU plugin (criu/bunshin_plugin.c, bunshin/criu/plugin.py) and the restore whose
clones share memory (bunshin.criu.restore_many), on real workspaces."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

import bunshin
from bunshin.errors import CheckpointError, CriuError

try:
    from bunshin.criu import runner as _runner

    _runner.criu()
except CriuError as e:
    pytest.skip(f"no usable CRIU >= 4 ({e})", allow_module_level=True)

from conftest import wait_for_bytes

from bunshin import criu, criu_build
from bunshin.criu import images, plugin
from bunshin.criu_locate import private_prefix
from bunshin.memory import pids_usage

_M = 1 << 20
_STOCK = str(private_prefix() / "bin" / "criu")  # Debian's, beside the patched build


def test_the_built_plugin_is_one_criu_4_2_loads():
    info = plugin.plugin_info()
    assert info.present, info.reason
    assert info.name == "bunshin" and info.version == plugin.ABI_VERSION
    assert info.hooks == ("DUMP_UNIX_SK", "RESTORE_UNIX_SK", "DUMP_EXT_FILE", "RESTORE_EXT_FILE")
    assert Path(info.path).parent == plugin.libdir()


def _which(**env: str) -> dict[str, str]:
    out = subprocess.run([sys.executable, "-m", "bunshin", "criu", "which"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, **env})
    assert out.returncode == 0, out.stdout + out.stderr
    return {k: v.strip() for k, v in (ln.split(":", 1) for ln in out.stdout.splitlines())}


def test_criu_which_says_the_plugin_and_the_patch_are_in_use():
    said = _which()
    assert said["build"].startswith("plugins: bunshin ") and plugin.plugin_info().path in said["build"]
    assert said["build"].endswith("patches: ext-files"), said
    assert said["path"] == f"{criu_build.patched_prefix() / 'bin' / 'criu'} (patched)", said


def test_criu_which_says_plainly_a_stock_criu_has_no_patch():
    said = _which(BUNSHIN_CRIU=_STOCK)
    assert said["usable"].startswith("yes"), said
    assert "patches: none — a stock CRIU" in said["build"], said


def test_the_patched_criu_is_built_from_the_current_patches():
    assert criu_build.is_current(), "run `bunshin criu provision` (make install does)"
    assert criu_build.patch_names() == ("ext-files",)
    assert _runner.criu().patches == ("ext-files",)
    assert criu_build.patches_in("bunshin+ext-files+other") == ("ext-files", "other")
    assert criu_build.patches_in("v4.2.1-3-gabc") == ()


def _shell_workspace():
    ws = bunshin.Workspace.create()
    sh = ws.shell()
    sh.run("cd /tmp && X=41")
    return ws


def test_a_restore_through_the_plugin_has_working_control_and_shells(family, tmp_path):
    ws = _shell_workspace()
    family.append(ws)
    meta = criu.dump_workspace(ws, tmp_path / "img")
    assert meta["ctl_socket_by"] == "plugin"
    log = (tmp_path / "img" / "criu" / "dump.log").read_text()
    assert "the workspace's control socket, restored by this plugin" in log
    assert f"unix[{meta['ctl_socket_ino']}]" not in log  # no --external for it
    assert ws.run("echo source").stdout == b"source\n"  # its real control socket is back
    w = criu.restore_workspace(tmp_path / "img")
    family.append(w)
    assert w.run("echo $((6*7))").stdout == b"42\n"
    assert w.shells[0].run("echo $X $PWD").stdout == b"41 /tmp\n"
    assert w.shell().run("echo new").stdout == b"new\n"
    (kid,) = w.fork(1)
    family.append(kid)
    assert kid.shells[0].run("echo $((X+1))").stdout == b"42\n"


def _ids(img: Path) -> dict[int, str]:
    return images.external_files(images.criu_dir(img), _runner.pycriu(_runner.criu()))


def test_host_files_go_through_the_plugin_on_the_patched_criu(family, tmp_path):
    ws = _shell_workspace()
    family.append(ws)
    meta = criu.dump_workspace(ws, tmp_path / "img")
    assert meta["files_by"] == "plugin"
    ids = _ids(tmp_path / "img")
    init_bin = next(e for e in meta["externals"] if e["path"].endswith("/bunshin-init"))
    assert init_bin["key"] in ids.values()  # CRIU recorded the init's binary as an external
    log = (tmp_path / "img" / "criu" / "dump.log").read_text()
    for fid, key in ids.items():  # each claimed by the plugin, none named in --external
        assert f"file {fid:#x} (" in log and f"is claimed by a plugin as {key}" in log, key
    w = criu.restore_workspace(tmp_path / "img")
    family.append(w)
    assert os.readlink(f"/proc/{w.init_pid}/exe") == init_bin["path"]
    assert w.shells[0].run("echo $X $PWD").stdout == b"41 /tmp\n"
    assert w.run("echo hi").stdout == b"hi\n"


def test_a_claimed_file_under_another_key_is_recorded_as_an_alias_or_fails_the_dump(family, tmp_path):
    from bunshin.criu import externals, handover

    ws = _shell_workspace()
    family.append(ws)
    meta = criu.dump_workspace(ws, tmp_path / "img")
    ids = _ids(tmp_path / "img")
    exts = [externals.External(**e) for e in meta["externals"]]
    assert {e.key for e in exts} >= set(ids.values())  # as dumped: nothing to add
    # the scan saw each file through another mount than CRIU's: same inodes, other keys
    moved = [dataclasses.replace(e, key=e.key.replace("file[", "file[ffff")) for e in exts]
    info, crit = _runner.criu(), tmp_path / "img" / "criu"
    got = handover.Plugin().dumped(crit, {"files_by": "plugin"}, moved, info)
    aliases = {e.key: e for e in got[len(moved):]}
    assert set(aliases) == set(ids.values())
    for key, e in aliases.items():
        assert e.path == next(x["path"] for x in meta["externals"] if x["key"] == key)
    strangers = [dataclasses.replace(e, devino=e.devino + "0") for e in moved]  # other inodes
    with pytest.raises(CheckpointError, match="did not find the workspace using"):
        handover.Plugin().dumped(crit, {"files_by": "plugin"}, strangers, info)


def test_images_restore_across_the_stock_and_the_patched_criu(family, tmp_path, monkeypatch):
    ws = _shell_workspace()
    family.append(ws)
    patched = criu.dump_workspace(ws, tmp_path / "by-patched")
    monkeypatch.setenv("BUNSHIN_CRIU", _STOCK)
    stock = criu.dump_workspace(ws, tmp_path / "by-stock")
    assert (patched["files_by"], stock["files_by"]) == ("plugin", "inherit-fd")
    log = (tmp_path / "by-stock" / "criu" / "dump.log").read_text()
    assert "claimed by a plugin" not in log  # a stock CRIU asks no plugin about a file
    assert set(_ids(tmp_path / "by-stock").values()) <= {e["key"] for e in stock["externals"]}
    w = criu.restore_workspace(tmp_path / "by-patched")  # by the stock CRIU: inherit_fd
    family.append(w)
    assert w.shells[0].run("echo $X").stdout == b"41\n"
    monkeypatch.delenv("BUNSHIN_CRIU")
    w = criu.restore_workspace(tmp_path / "by-stock")  # by the patched CRIU
    family.append(w)
    assert w.shells[0].run("echo $X").stdout == b"41\n"


def test_the_fd_server_sends_many_fds_in_bounded_messages_then_ends(tmp_path):
    import socket

    r, w = os.pipe()
    try:
        files = {fid: r for fid in range(1, 151)}
        with plugin.FdServer({7: w}, files) as srv:
            got: list[str] = []
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                c.connect(srv.options().env[plugin.ENV_FDS])
                while True:
                    body, fds, _flags, _addr = socket.recv_fds(c, 4096, 100)
                    if not body and not fds:
                        break
                    toks = body.decode().split()
                    assert toks[:2] == ["bunshin-criu-fds", "1"] and len(toks) - 2 == len(fds) <= 64
                    got += toks[2:]
                    for fd in fds:
                        os.close(fd)
        assert srv.served
        assert got == ["unix:7", *(f"file:{i}" for i in range(1, 151))]
    finally:
        os.close(r)
        os.close(w)


def test_an_image_dumped_without_the_plugin_still_restores(family, tmp_path, monkeypatch):
    ws = _shell_workspace()
    family.append(ws)
    monkeypatch.setattr(plugin, "available", lambda: False)
    meta = criu.dump_workspace(ws, tmp_path / "img")
    monkeypatch.undo()
    assert meta["ctl_socket_by"] == "inherit-fd"
    w = criu.restore_workspace(tmp_path / "img")
    family.append(w)
    assert w.shells[0].run("echo $X").stdout == b"41\n"


def test_a_plugin_that_cannot_reach_bunshin_fails_the_restore_cleanly(no_leaks, tmp_path, monkeypatch):
    with bunshin.Workspace.create() as ws:
        criu.dump_workspace(ws, tmp_path / "img")
    nobody = str(tmp_path / "nobody-listens")
    monkeypatch.setattr(plugin.FdServer, "options",
                        lambda self: plugin.Options(str(plugin.libdir()), {plugin.ENV_FDS: nobody}))
    with pytest.raises(CheckpointError) as ei:
        criu.restore_workspace(tmp_path / "img")
    msg = str(ei.value)
    assert f"cannot reach Bunshin at {nobody}" in msg and "never took" in msg, msg
    if ei.value.log:
        os.unlink(ei.value.log)
    monkeypatch.undo()
    w = criu.restore_workspace(tmp_path / "img")  # nothing of the failed one is in the way
    assert w.run("true").exit_code == 0
    w.close()


def _worker_workspace(mib: int):
    """A workspace with a Python worker holding ``mib`` MiB of random (distinct) pages."""
    ws = bunshin.Workspace.create()
    ws.spawn(["python3", "-c", f"import os,time\nb=bytearray(os.urandom({mib}<<20))\n"
              "open('/tmp/ready','w').write('ok')\nwhile True: time.sleep(1)"])
    assert wait_for_bytes(ws, "/tmp/ready", b"ok") == b"ok"
    return ws


def test_restore_many_clones_share_the_images_memory(family, tmp_path):
    ws = _worker_workspace(32)
    family.append(ws)
    criu.dump_workspace(ws, tmp_path / "img")
    one = criu.restore_workspace(tmp_path / "img")
    family.append(one)
    single = pids_usage({one.id: one.host_pids()}, pss=False).total_bytes
    kids = criu.restore_many(tmp_path / "img", 4)
    family.extend(kids)
    shared = pids_usage({k.id: k.host_pids() for k in kids}, pss=False).total_bytes
    assert single > 32 * _M
    assert shared < 1.2 * single, (shared / _M, single / _M)
    # independent clones all the same
    kids[0].write_file("/tmp/mine", "0")
    assert [k.run("cat /tmp/mine 2>/dev/null || echo none").stdout for k in kids[1:]] == [b"none\n"] * 3
    assert {os.readlink(f"/proc/{k.init_pid}/ns/pid") for k in kids}.__len__() == 4


def test_restore_many_refuses_no_clones(tmp_path):
    with pytest.raises(ValueError):
        criu.restore_many(tmp_path, 0)
