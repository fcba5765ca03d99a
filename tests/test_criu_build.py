"""Building Bunshin's CRIU (bunshin/criu_build.py): what makes a build current, and a build
that fails leaving nothing behind (Debian's real source; the full build runs at install)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bunshin import criu_build
from bunshin.criu_locate import private_prefix
from bunshin.errors import UnsupportedKernel


@pytest.fixture
def own_patches(tmp_path, monkeypatch):
    d = tmp_path / "patches"
    shutil.copytree(criu_build.patches_dir(), d)
    monkeypatch.setattr(criu_build, "patches_dir", lambda: d)
    return d


def test_a_changed_patch_makes_the_build_stale(own_patches, tmp_path):
    prefix = tmp_path / "prefix"
    shutil.copytree(criu_build.patched_prefix(), prefix, symlinks=True)
    assert criu_build.is_current(prefix)
    p = next(own_patches.glob("*.patch"))
    p.write_text(p.read_text() + "\n")
    assert not criu_build.is_current(prefix)
    (own_patches / "more.patch").write_text("")
    assert criu_build.patch_names() == ("ext-files", "more")


@pytest.mark.skipif(not (private_prefix() / "bin" / "criu").is_file(), reason="no stock private CRIU")
def test_a_patch_that_does_not_apply_fails_the_build_and_leaves_nothing(own_patches, tmp_path):
    (own_patches / "ext-files.patch").write_text(
        "--- a/criu/files-reg.c\n+++ b/criu/files-reg.c\n@@ -1,1 +1,1 @@\n-no such line\n+x\n")
    prefix = tmp_path / "criu-bunshin"
    with pytest.raises(UnsupportedKernel) as ei:
        criu_build.build_criu(prefix)
    assert "patch -p1" in str(ei.value) and "FAILED" in str(ei.value), ei.value
    assert list(tmp_path.iterdir()) == [own_patches]  # neither the prefix nor its stage


def test_provision_if_needed_leaves_a_current_build_alone():
    stamp = criu_build.patched_prefix() / "stamp"
    before = stamp.stat().st_mtime_ns
    out = subprocess.run([sys.executable, "-m", "bunshin", "criu", "provision", "--if-needed"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(patched)" in out.stdout and "patches: ext-files" in out.stdout, out.stdout
    assert stamp.stat().st_mtime_ns == before  # neither fetched nor built again


def test_make_install_installs_every_build_dependency():
    text = (Path(__file__).resolve().parents[1] / "scripts" / "install-deps.sh").read_text()
    lines = text[text.index("APT_PKGS=(") + len("APT_PKGS=("):].splitlines()
    listed = [ln.split("#", 1)[0] for ln in lines[:lines.index(")")]]
    words = {w for line in listed for w in line.split()}
    assert set(criu_build.BUILD_DEPS) <= words, set(criu_build.BUILD_DEPS) - words
