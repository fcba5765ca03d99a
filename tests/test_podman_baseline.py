"""bench/_podman.py, the real-container baseline of bench/e2e.py: a group run in podman containers
(setup replayed in each) and from podman's CRIU checkpoint of a set-up container, tool calls as
``podman exec``, memory sampled from the containers' cgroups; nothing is left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import _podman  # noqa: E402

from bunshin.cache.toolcall import ToolCall  # noqa: E402
from bunshin.criu_locate import find_criu  # noqa: E402
from bunshin.rl import ReplayPolicy, Task  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.network]

# a process started by the setup that counts in its own memory: after a restore it goes on
# from where the checkpoint left it, in a fresh container it starts again
COUNTER = ("setsid bash -c 'n=0; while :; do n=$((n+1)); echo \"$n $(cat /srv/app/state)\" > /tmp/count.part; "
           "mv /tmp/count.part /tmp/count; sleep 0.05; done' </dev/null >/dev/null 2>&1 & echo started")
# a server on loopback, started by the setup: it must answer in every rollout, restored ones too
SERVER = ("setsid perl -MIO::Socket::INET -e '$s = IO::Socket::INET->new(LocalAddr => \"127.0.0.1:7777\", "
          "Listen => 5, ReuseAddr => 1) or die; while ($c = $s->accept) { print $c \"served\\n\"; close $c }' "
          "</dev/null >/dev/null 2>&1 & echo started")
ASK = "exec 3<>/dev/tcp/127.0.0.1/7777 && head -1 <&3"
TASK = Task(id="podman-baseline", prompt="", workdir="/srv/app", max_steps=6,
            setup=(ToolCall("write_file", {"path": "/srv/app/state", "content": "set-up"}),
                   ToolCall("bash", {"command": COUNTER}), ToolCall("bash", {"command": SERVER})),
            ready=f"test -s /tmp/count && {ASK}")


def _trace(i: int) -> list[ToolCall]:
    return [ToolCall("bash", {"command": "pwd; cat state"}),
            ToolCall("write_file", {"path": f"/srv/app/member-{i}", "content": f"member {i}\n"}),
            ToolCall("read_file", {"path": f"/srv/app/member-{i}"}),
            ToolCall("bash", {"command": "ls /srv/app | tr '\\n' ' '; echo; sleep 0.3; cat /tmp/count"}),
            ToolCall("bash", {"command": ASK})]


def _podman_names(kind: str) -> str:
    fmt = "{{.Names}}" if kind == "ps" else "{{.Repository}}:{{.Tag}}"
    args = ["podman", "ps", "-a", "--format", fmt] if kind == "ps" else ["podman", "images", "--format", fmt]
    return subprocess.run(args, capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def image():
    from bunshin.runtime.rootfs import build_debian

    criu = find_criu()
    why = _podman.why_not(str(criu.path) if criu and criu.usable else None, "podman")
    if why is not None:
        pytest.skip(why)
    img = _podman.Image(_podman.Podman(), build_debian("bookworm"), _podman.image_tag())
    try:
        yield img.tag
    finally:
        img.close()
        assert img.tag.split("/", 1)[1] not in _podman_names("images")


@pytest.mark.parametrize("mode", _podman.MODES)
def test_group_in_real_containers(image, mode):
    criu = find_criu()
    if mode == "podman-checkpoint":
        why = _podman.why_not(str(criu.path) if criu and criu.usable else None, mode)
        if why is not None:
            pytest.skip(why)
    policy = ReplayPolicy([_trace(0), _trace(1)], think_s=0.05)
    g = _podman.run_group(mode, image, TASK, policy, 2, str(criu.path) if criu else None)
    assert not g.errors
    counts = []
    for t in g.trajectories:
        i = t.index
        obs = [turn.observation for turn in t.turns]
        assert [turn.exit_code for turn in t.turns] == [0, 0, 0, 0, 0]
        assert obs[4] == "served\n"  # the set-up server answers on loopback
        assert obs[0] == "/srv/app\nset-up"
        assert obs[2] == f"member {i}\n"
        listing, count = obs[3].split("\n", 1)[0], obs[3].split("\n", 1)[1]
        # each rollout has its own container: it sees its own file, not the other's
        assert f"member-{i}" in listing and f"member-{1 - i}" not in listing
        n, state = count.split()
        assert state == "set-up"
        counts.append(int(n))
    if mode == "podman-checkpoint":
        # the counter was restored mid-count: setup, ready and checkpoint took many steps of it
        assert all(n > 5 for n in counts), counts
        assert g.extra["checkpoint_bytes"] > 0 and g.extra["restore_p50_s"] > 0
    assert g.memory is not None and g.memory.peak_bytes > 1 << 20 and len(g.memory.times) > 3
    assert f"bunshin-e2e-{os.getpid()}-" not in _podman_names("ps")
