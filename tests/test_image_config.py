"""An image's own config (Env, WorkingDir, User, Entrypoint/Cmd) in its workspaces and their forks.

The image is made here the way a registry would serve it (an OCI layout: index.json, manifest,
config blob, layer tar; and a ``docker save`` archive) with a config like a SWE-bench image's:
a tool directory first on PATH (``/opt/conda/bin``), a working directory, a non-root user.
What runs in the workspace reports its own ids, directory and environment."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from test_rootfs import TarBuilder, blob, busybox_root

import bunshin
from bunshin.runtime.rootfs.image_config import ImageConfig, UnknownUser, User, resolve_user
from bunshin.criu_locate import find_criu
from bunshin.runtime.workspace_config import WorkspaceConfig

_CRIU = find_criu()  # in the real cache directory, before a test points it elsewhere

PASSWD = b"root:x:0:0:root:/root:/bin/sh\ndev:x:1000:1000:dev:/home/dev:/bin/sh\n"
GROUP = b"root:x:0:\ndev:x:1000:\ntools:x:2000:dev\nother:x:3000:root\n"
CONFIG = {
    "Env": ["PATH=/opt/conda/bin:/usr/bin:/bin", "CONDA_DEFAULT_ENV=testbed"],
    "WorkingDir": "/work",
    "User": "dev",
    "Entrypoint": ["/bin/sh", "-c"],
    "Cmd": ["echo \"$(id -u) $PWD\" > /tmp/served"],
}
# what a process of the workspace says of itself: ids, groups, directory, environment, which
# python PATH finds, and whether it may write a root-only directory
REPORT = ('echo "$(id -u):$(id -g):$(id -G):$PWD:$HOME:$CONDA_DEFAULT_ENV:$(python):'
          '$(touch /root/x 2>/dev/null && echo root-writable || echo root-denied)"')
AS_DEV = b"1000:1000:1000 2000:/work:/home/dev:testbed:conda-python:root-denied\n"
LOOP = f"while :; do {REPORT} > /tmp/live.part; mv /tmp/live.part /tmp/live; sleep 0.05; done"


def image_layer() -> bytes:
    tb = busybox_root()
    for applet in ("id", "pwd", "touch", "sleep", "mv", "rm"):
        tb.symlink(f"bin/{applet}", "busybox")
    tb.file("etc/group", GROUP)
    tb.dir("root", mode=0o700).dir("work").dir("home/dev", mode=0o700, uid=1000, gid=1000)
    tb.dir("opt/conda/bin").file("opt/conda/bin/python", b"#!/bin/sh\necho conda-python\n", mode=0o755)
    return tb.bytes()


def _top_layer() -> bytes:
    # the passwd with the user comes in a layer of its own, as a RUN useradd would add it
    return TarBuilder().dir("etc").file("etc/passwd", PASSWD).bytes()


def make_oci_image(layout, config: dict, extra_layers: tuple[bytes, ...] = ()) -> None:
    layout.mkdir(parents=True)
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    layers = [image_layer(), _top_layer(), *extra_layers]
    cfg = {"architecture": "amd64", "os": "linux", "config": config,
           "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(d).hexdigest()}" for d in layers]}}
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {**blob(layout, json.dumps(cfg).encode()),
                           "mediaType": "application/vnd.oci.image.config.v1+json"},
                "layers": [{**blob(layout, d), "mediaType": "application/vnd.oci.image.layer.v1.tar"}
                           for d in layers]}
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [{**blob(layout, json.dumps(manifest).encode()),
                            "mediaType": "application/vnd.oci.image.manifest.v1+json",
                            "platform": {"os": "linux", "architecture": "amd64"}}]}
    (layout / "index.json").write_text(json.dumps(index))


def make_docker_archive(path, config: dict):
    layers = [image_layer(), _top_layer()]
    digests = [hashlib.sha256(d).hexdigest() for d in layers]
    cfg = json.dumps({"os": "linux", "architecture": "amd64", "config": config,
                      "rootfs": {"type": "layers", "diff_ids": [f"sha256:{d}" for d in digests]}}).encode()
    tb = TarBuilder()
    for i, data in enumerate(layers):
        tb.dir(f"{i:064x}").file(f"{i:064x}/layer.tar", data)
    name = hashlib.sha256(cfg).hexdigest() + ".json"
    tb.file(name, cfg).file("manifest.json", json.dumps(
        [{"Config": name, "RepoTags": ["dev:1"], "Layers": [f"{i:064x}/layer.tar" for i in range(2)]}]).encode())
    return tb.write(path)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BUNSHIN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def image(tmp_path, cache):
    make_oci_image(tmp_path / "oci", CONFIG)
    return tmp_path / "oci"


def _live(ws: bunshin.Workspace) -> bytes:
    """The running loop's next report (written after this call, by the process itself)."""
    ws.exec(["rm", "-f", "/tmp/live"], cwd="/")
    end = time.monotonic() + 20
    while time.monotonic() < end:
        try:
            return ws.read_file("/tmp/live")
        except bunshin.BunshinError:
            time.sleep(0.02)
    raise AssertionError("the image user's loop wrote no report")


def _check(ws: bunshin.Workspace) -> None:
    assert ws.run(REPORT).stdout == AS_DEV
    assert _live(ws) == AS_DEV
    assert ws.run("echo hi > $HOME/mine && cat $HOME/mine").stdout == b"hi\n"
    # what the trainer writes for the agent is the agent's to change, as if it had written it
    ws.write_file("/home/dev/new/notes.txt", "draft\n")
    assert ws.run("echo more >> /home/dev/new/notes.txt && touch /home/dev/new/x && "
                  "cat /home/dev/new/notes.txt").stdout == b"draft\nmore\n"
    ws.write_file("/home/dev/new/notes.txt", "again\n")


@pytest.mark.parametrize("isolation", ["trusted", "sandbox"])
def test_image_env_workdir_user_in_workspace_and_forks(no_leaks, image, isolation):
    with bunshin.Workspace.create(rootfs=image, isolation=isolation) as ws:
        assert ws.config.user == User(uid=1000, gid=1000, groups=(2000,), home="/home/dev")
        assert ws.image_cmd == ("/bin/sh", "-c", CONFIG["Cmd"][0])
        ws.spawn(["sh", "-c", LOOP])
        _check(ws)
        [kid] = ws.fork()
        with kid:
            _check(kid)
            assert kid.image_cmd == ws.image_cmd
        _check(ws)  # the source goes on as it was
        with ws.snapshot() as tpl:
            [kid2] = tpl.fork()
            with kid2:
                _check(kid2)
        _check(ws)


def test_user_on_the_default_root_in_shells_and_forks(no_leaks):
    """user= on a root that is not an image: the host view's own /etc/passwd names it; the
    session shell (bash, which the busybox image lacks) runs as it, and so do its forks'."""
    with bunshin.Workspace.create(user="nobody") as ws:
        sh = ws.shell()
        who = b"65534:65534:/nonexistent\n"
        assert sh.run('echo "$(id -u):$(id -g):$HOME"').stdout == who
        sh.run("cd /tmp && X=kept")
        [kid] = ws.fork()
        with kid:
            assert kid.shells[0].run('echo "$(id -u):$(id -g):$HOME:$PWD:$X"').stdout == who[:-1] + b":/tmp:kept\n"
            assert kid.run("id -u").stdout == b"65534\n"
        assert sh.run('echo "$(id -u):$PWD:$X"').stdout == b"65534:/tmp:kept\n"


def test_image_cmd_runs_as_the_image_user(no_leaks, image):
    with bunshin.Workspace.create(rootfs=image) as ws:
        pid = ws.spawn(list(ws.image_cmd))
        assert ws.wait(pid, timeout=20) == 0
        assert ws.read_file("/tmp/served") == b"1000 /work\n"


def test_create_arguments_override_the_image(no_leaks, image):
    with bunshin.Workspace.create(rootfs=image, user="root", workdir="/", env={"PATH": "/bin"}) as ws:
        r = ws.run('echo "$(id -u):$PWD:$HOME:$CONDA_DEFAULT_ENV"; python')
        assert r.stdout == b"0:/:/root:testbed\n" and r.exit_code == 127
    with bunshin.Workspace.create(rootfs=image, user="1000:tools", env={"HOME": "/tmp"}) as ws:
        assert ws.run('echo "$(id -u):$(id -g):$(id -G):$HOME"').stdout == b"1000:2000:2000:/tmp\n"
    with bunshin.Workspace.create(rootfs=image, user="4321") as ws:  # a uid with no entry: gid 0
        assert ws.run('echo "$(id -u):$(id -g):$HOME"').stdout == b"4321:0:/\n"


def test_docker_archive_config(no_leaks, tmp_path, cache):
    archive = make_docker_archive(tmp_path / "dev.docker.tar", CONFIG)
    with bunshin.Workspace.create(rootfs=archive) as ws:
        assert ws.run(REPORT).stdout == AS_DEV
    # the second resolve comes from the archive index, config included
    with bunshin.Workspace.create(rootfs=archive) as ws:
        assert ws.run(REPORT).stdout == AS_DEV


@pytest.mark.parametrize("user,what", [("nobody-here", "user 'nobody-here'"),
                                       ("dev:nogroup", "group 'nogroup'")])
def test_unknown_user_is_refused(no_leaks, tmp_path, cache, user, what):
    make_oci_image(tmp_path / "oci", {**CONFIG, "User": user})
    with pytest.raises(UnknownUser, match=what) as e:
        bunshin.Workspace.create(rootfs=tmp_path / "oci")
    assert "image" in str(e.value) and isinstance(e.value, bunshin.BunshinError)
    with pytest.raises(UnknownUser, match="user="):
        bunshin.Workspace.create(rootfs=tmp_path / "oci", user="ghost")


def test_resolve_user_forms():
    def r(spec):
        return resolve_user(spec, PASSWD, GROUP, "test")

    assert r("dev") == r("1000") == User(1000, 1000, (2000,), "/home/dev")
    assert r("root") == User(0, 0, (3000,), "/root")
    assert r("dev:other") == User(1000, 3000, (), "/home/dev")
    assert r("7:8") == User(7, 8, (), "/")
    with pytest.raises(UnknownUser):
        r("a:b:c")


def test_config_round_trips():
    cfg = ImageConfig.of_image({"config": CONFIG})
    assert ImageConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.workdir == "/work" and dict(cfg.env)["CONDA_DEFAULT_ENV"] == "testbed"
    ws_cfg = WorkspaceConfig(env={"A": "1"}, workdir="/w", max_output=10, user=User(1, 2, (3,), "/h"),
                             image_cmd=cfg.command)
    assert WorkspaceConfig.from_dict(json.loads(json.dumps(ws_cfg.to_dict()))) == ws_cfg


def test_criu_restore_keeps_the_image_config(no_leaks, image, tmp_path, monkeypatch):
    if _CRIU is None or not _CRIU.usable:
        pytest.skip("no usable CRIU >= 4; `python3 -m bunshin criu provision` installs one")
    monkeypatch.setenv("BUNSHIN_CRIU", _CRIU.path)  # the cache dir is this test's own
    from bunshin import criu

    with bunshin.Workspace.create(rootfs=image) as ws:
        ws.spawn(["sh", "-c", LOOP])
        assert _live(ws) == AS_DEV
        criu.dump_workspace(ws, tmp_path / "img")
    with criu.restore_workspace(tmp_path / "img") as back:
        assert back.config.user == User(1000, 1000, (2000,), "/home/dev")
        assert back.run(REPORT).stdout == AS_DEV
        assert _live(back) == AS_DEV


def test_rootfs_show_prints_the_image_config(image):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "bunshin", "rootfs", "show", str(image)], capture_output=True,
                         text=True, check=True).stdout
    d = json.loads(out)
    assert d["kind"] == "oci" and len(d["lowers"]) == 2
    assert d["image"]["user"] == "dev" and d["image"]["workdir"] == "/work"
    assert d["image"]["entrypoint"] + d["image"]["cmd"] == ["/bin/sh", "-c", CONFIG["Cmd"][0]]


def _image_with_bash(tmp_path) -> Path:
    """The test image plus the host's bash (and the libraries it loads) in a layer of its own:
    bunshin.rl's rollouts run their tool calls in a bash session."""
    libs = re.findall(r"(/\S+) \(0x", subprocess.run(["ldd", "/bin/bash"], capture_output=True, text=True,
                                                     check=True).stdout)
    tb = TarBuilder().dir("usr").dir("usr/bin").file("usr/bin/bash", Path("/bin/bash").read_bytes(), mode=0o755)
    made = {"usr", "usr/bin"}
    for lib in libs:
        parts = Path(lib).relative_to("/").parts
        for i in range(1, len(parts)):
            d = "/".join(parts[:i])
            if d not in made:
                tb.dir(d)
                made.add(d)
        tb.file("/".join(parts), Path(lib).read_bytes(), mode=0o755)
    for applet in ("mkdir", "test"):
        tb.symlink(f"usr/bin/{applet}", "/bin/busybox")
    make_oci_image(tmp_path / "oci-bash", CONFIG, extra_layers=(tb.bytes(),))
    return tmp_path / "oci-bash"


@pytest.mark.parametrize("mode", ["fresh", "fork"])
def test_a_rollout_of_an_image_task_runs_with_the_image_config(no_leaks, tmp_path, cache, mode):
    """bunshin.rl: a task on an image (no workdir of its own) sets up and rolls out in the
    image's WorkingDir, as its User, with its Env; its verifier runs there too."""
    from bunshin.rl import ReplayPolicy, RolloutEngine, Task, Verifier

    task = Task("img", "report", rootfs=_image_with_bash(tmp_path), setup=["echo set-up > /tmp/here"],
                verifier=Verifier('test "$PWD" = /work && cat /tmp/here'))
    with RolloutEngine(ReplayPolicy([[REPORT]]), task, 2, mode=mode, sample_interval=None) as eng:
        g = eng.run()
    assert g.errors == []
    for t in g.trajectories:
        assert t.turns[0].observation.encode() == AS_DEV
        assert (t.verdict.passed, t.verdict.output) == (True, "set-up\n")
