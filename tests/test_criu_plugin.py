"""Bunshin's CRIU plugin (criu/bunshin_plugin.c, bunshin/criu/plugin.py) and the restore whose
clones share memory (bunshin.criu.restore_many), on real workspaces."""

from __future__ import annotations

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

from bunshin import criu
from bunshin.criu import plugin
from bunshin.memory import pids_usage

_M = 1 << 20


def test_the_built_plugin_is_one_criu_4_2_loads():
    info = plugin.plugin_info()
    assert info.present, info.reason
    assert info.name == "bunshin" and info.version == plugin.ABI_VERSION
    assert info.hooks == ("DUMP_UNIX_SK", "RESTORE_UNIX_SK")
    assert Path(info.path).parent == plugin.libdir()


def test_criu_which_says_the_plugin_is_in_use():
    out = subprocess.run([sys.executable, "-m", "bunshin", "criu", "which"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    build = dict(ln.split(":", 1) for ln in out.stdout.splitlines())["build"].strip()
    assert build.startswith("plugins: bunshin ") and plugin.plugin_info().path in build, build


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
