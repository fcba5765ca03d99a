"""The state file system Bunshin mounts is a scratch image of live workspaces: no write
barriers (each ws.fork()'s btrfs snapshot commits a transaction, whose cache flush would be an
fsync of the image file), also for an image an older version mounted with them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bunshin.runtime import statefs


def _options(mountpoint: Path) -> list[str]:
    opts = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(mountpoint):
            opts = fields[fields.index("-") + 3].split(",")
    assert opts is not None, f"{mountpoint} is not mounted"
    return opts


def test_the_state_file_system_has_no_barriers(no_leaks):
    assert "nobarrier" in _options(statefs.ensure())


@pytest.fixture
def own_state(tmp_path, monkeypatch):
    """A state directory of this test's own (its image, mounted by hand)."""
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("BUNSHIN_STATE_DIR", str(state))
    yield state
    subprocess.run(["umount", str(state)], capture_output=True)


def test_an_image_mounted_with_barriers_loses_them(own_state):
    img = statefs.image_path(own_state)
    subprocess.run(["truncate", "-s", "1G", str(img)], check=True)
    subprocess.run(statefs._mkfs(str(img)), check=True, capture_output=True)
    subprocess.run(["mount", "-o", "loop,noatime", str(img), str(own_state)], check=True)
    assert "nobarrier" not in _options(own_state)
    assert statefs.ensure() == own_state
    assert "nobarrier" in _options(own_state)


def test_a_file_system_of_the_users_own_is_left_as_it_is(own_state):
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(own_state)], check=True)
    before = _options(own_state)
    assert statefs.ensure() == own_state
    assert _options(own_state) == before
