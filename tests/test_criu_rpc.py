"""CRIU driven through pycriu's RPC: every CRIU process Bunshin starts is a ``criu swrk``
worker, a CRIU failure's own error lines reach the CheckpointError, a worker that hangs is
killed at its deadline, and ``bunshin criu which`` says how CRIU is driven."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

import bunshin
from bunshin.errors import CheckpointError, CriuError

try:
    from bunshin.criu import runner

    _INFO = runner.criu()
except CriuError as e:
    pytest.skip(f"no usable CRIU >= 4 ({e}); `python3 -m bunshin criu provision` installs one",
                allow_module_level=True)

from bunshin import criu, criu_rpc
from bunshin.criu import images as layout

# A shell whose state (a variable, its cwd) and a process holding a file open: what a dump and
# restore must carry, checked in the restored workspace and, after the dump, in the source
_STATE = "cd /tmp && V=before-dump && exec 7>/tmp/held && echo held >&7"
_CHECK = "echo $V $PWD; readlink /proc/$$/fd/7"


def _logging_criu(tmp_path: Path) -> tuple[Path, Path]:
    """A CRIU install at ``tmp_path/c`` whose ``bin/criu`` logs its argv (one line a run) and
    execs the real CRIU; its pycriu is the real one's."""
    prefix = tmp_path / "c"
    (prefix / "bin").mkdir(parents=True)
    site = prefix / "sysroot" / "usr" / "lib" / "python3" / "dist-packages"
    site.mkdir(parents=True)
    assert _INFO.pycriu
    (site / "pycriu").symlink_to(Path(_INFO.pycriu) / "pycriu")
    argv_log = tmp_path / "argv.log"
    wrapper = prefix / "bin" / "criu"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {shlex.quote(str(argv_log))}\n'
                       f'exec {shlex.quote(_INFO.path)} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, argv_log


def test_every_criu_run_is_an_rpc_worker(family, tmp_path, monkeypatch):
    wrapper, argv_log = _logging_criu(tmp_path)
    monkeypatch.setenv("BUNSHIN_CRIU", str(wrapper))
    # locate (VERSION and CHECK), dump and restore, each through the wrapper
    assert runner.criu().path == str(wrapper)
    ws = bunshin.Workspace.create(isolation="trusted")
    family.append(ws)
    sh = ws.shell()
    sh.run(_STATE)
    criu.dump_workspace(ws, tmp_path / "img")
    assert sh.run(_CHECK).stdout == b"before-dump /tmp\n/tmp/held\n"  # the source runs on
    w = criu.restore_workspace(tmp_path / "img")
    family.append(w)
    assert w.shells[0].run(_CHECK).stdout == b"before-dump /tmp\n/tmp/held\n"
    runs = argv_log.read_text().splitlines()
    assert len(runs) >= 3, runs  # VERSION+CHECK, DUMP, RESTORE
    assert all(len(a.split()) == 2 and a.split()[0] == "swrk" and a.split()[1].isdigit()
               for a in runs), runs
    out = subprocess.run([sys.executable, "-m", "bunshin", "criu", "which"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "BUNSHIN_CRIU": str(wrapper)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert all(a.split()[0] == "swrk" for a in argv_log.read_text().splitlines())


def test_criu_which_says_rpc_through_which_pycriu():
    out = subprocess.run([sys.executable, "-m", "bunshin", "criu", "which"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = dict(ln.split(":", 1) for ln in out.stdout.splitlines())
    assert _INFO.path in lines["path"]
    assert lines["version"].strip() == runner.version_string(_INFO)
    assert "RPC (criu swrk)" in lines["driver"]
    assert f"pycriu {_INFO.pycriu_version}" in lines["driver"] and _INFO.pycriu in lines["driver"]
    assert lines["build"].strip().startswith(("stock CRIU", "plugins:"))
    assert lines["usable"].strip().startswith("yes")


def test_a_criu_failure_carries_its_error_lines(no_leaks, tmp_path):
    with bunshin.Workspace.create(isolation="trusted") as ws:
        ws.shell().run(_STATE)
        criu.dump_workspace(ws, tmp_path / "img")
    # rewritten with pycriu's image module: the init's pid given to a process of the tree too,
    # which CRIU refuses when it reads the tree
    images = criu_rpc.pycriu(_INFO.pycriu or "").images
    pstree = tmp_path / "img" / "criu" / "pstree.img"
    with open(pstree, "rb") as f:
        tree = images.load(f)
    assert len(tree["entries"]) >= 2
    tree["entries"][1]["pid"] = tree["entries"][0]["pid"]
    with open(pstree, "wb") as f:
        images.dump(tree, f)
    meta = json.loads((tmp_path / "img" / "meta.json").read_text())
    meta["files"] = layout.inventory(tmp_path / "img")  # our own checksums pass: CRIU refuses
    (tmp_path / "img" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="CRIU restore") as ei:
        criu.restore_workspace(tmp_path / "img")
    kept = Path(ei.value.log or "")
    try:
        errors = [ln.strip() for ln in kept.read_text().splitlines()
                  if "Error (" in ln and "RLIMIT_NOFILE" not in ln]  # that one is benign here
        assert errors, kept.read_text()[-2000:]
        for line in errors[-6:]:
            assert line in str(ei.value)
    finally:
        kept.unlink(missing_ok=True)


def test_a_hung_worker_is_killed_at_its_deadline(tmp_path):
    hung = tmp_path / "criu"
    hung.write_text(f"#!/bin/sh\necho $$ > {tmp_path}/pid\nexec sleep 600\n")
    hung.chmod(0o755)
    info = dataclasses.replace(_INFO, path=str(hung))
    opts = runner.options(info, pid=1)
    start = time.monotonic()
    with pytest.raises(CheckpointError, match="did not finish within 1 s and was killed"):
        runner.call(info, "dump", opts, what="a dump", logfile=tmp_path / "dump.log", timeout=1)
    assert time.monotonic() - start < 10
    pid = int((tmp_path / "pid").read_text())
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped
