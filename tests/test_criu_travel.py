"""Templates that travel: an image saved here is loaded by another process whose state dir and
layer cache are fresh (a node that never saw the image's rootfs layers), with its layers fetched
from a shared store, from a callable streaming them from this node, or packed with the image;
corrupt and missing layers are refused by digest, and the host's system by its fingerprint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import bunshin
from bunshin.errors import CriuError, ForeignHost

try:
    from bunshin.criu import runner as _runner

    _CRIU = _runner.criu().path
except CriuError as e:
    pytest.skip(f"no usable CRIU >= 4 ({e})", allow_module_level=True)

from conftest import wait_file
from test_rootfs import busybox_root

from bunshin import criu
from bunshin.criu import layerstore

ROOT = Path(__file__).resolve().parents[1]

# The process left in the template holds X in its memory; fed a line on /tmp/fifo, it writes
# X + 1 (42) where it was told to: its state, checked by itself, wherever it runs.
_WAITER = "X=41; echo ready > /tmp/ready; read line < /tmp/fifo; echo $((X+1)) $line > /tmp/answer"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BUNSHIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("BUNSHIN_CRIU", _CRIU)  # the private CRIU lives in the default cache
    monkeypatch.delenv("BUNSHIN_LAYER_STORE", raising=False)
    return tmp_path / "cache"


def _answer(w, tag: str) -> str:
    w.run(f"echo {tag} > /tmp/fifo")
    return wait_file(w, "/tmp/answer").strip()


def _saved(tmp_path: Path) -> tuple[Path, str]:
    """A template saved from a workspace on a cached busybox layer; (image, layer digest).
    The source answers after the save as it did before."""
    archive = busybox_root().write(tmp_path / "root.tar.gz", "gz")
    with bunshin.Workspace.create(rootfs=archive) as ws:
        ws.run("echo travelled > /etc/travel; rm /etc/hostname; mkfifo /tmp/fifo")
        ws.spawn(["/bin/busybox", "sh", "-c", _WAITER])
        wait_file(ws, "/tmp/ready")
        tpl = ws.snapshot()
        try:
            tpl.save(tmp_path / "img")
            kid = tpl.fork(1)[0]
            with kid:
                assert _answer(kid, "kid") == "42 kid"
        finally:
            tpl.close()
        assert _answer(ws, "source") == "42 source"
    digests = criu.image_layers(tmp_path / "img")
    assert len(digests) == 1
    return tmp_path / "img", digests[0]


# Runs in the other node: loads the image (with SOURCE, a Python expression), forks two
# children, has each answer, and reports what it saw (an ImageError too); leaves nothing
# behind (its state file system is released, which only happens when no workspace is left).
_NODE = r'''
import json, os, subprocess, sys
import bunshin
from bunshin import criu, errors
from bunshin.criu import layerstore
from bunshin.runtime import statefs
img, digest = sys.argv[1], sys.argv[2]
def owner(d):
    """A callable source: the layer streamed from the owner node's store through a pipe."""
    env = dict(os.environ, **json.loads(sys.argv[3]))
    p = subprocess.Popen([sys.executable, "-c", "import sys; from bunshin.criu import layer_chunks\n"
                          "for b in layer_chunks(sys.argv[1]): sys.stdout.buffer.write(b)", d],
                         stdout=subprocess.PIPE, env=env)
    while b := p.stdout.read(1 << 16):
        yield b
    assert p.wait() == 0
out = {}
tpl, kids = None, []
try:
    SETUP
    tpl = bunshin.Template.load(img, layers=SOURCE)
    kids = tpl.fork(2)
    tpl.close()
    for i, k in enumerate(kids):
        k.run(f"echo kid{i} > /tmp/fifo")
        r = k.run("while [ ! -s /tmp/answer ]; do /bin/busybox sleep 0.05; done; cat /tmp/answer;"
                  " cat /etc/travel; ls /etc; /bin/busybox stat -c '%a %u' /usr/bin/su")
        out[f"kid{i}"] = r.stdout.decode()
    layer = layerstore.store_dir() / digest
    out["stored"] = layer.is_dir() and not layer.is_symlink()
except errors.ImageError as e:
    out["error"] = [type(e).__name__, str(e)]
finally:  # whatever happened, this node ends with nothing left
    for w in [*kids, tpl]:
        if w is not None:
            w.close()
    out["store"] = sorted(os.listdir(layerstore.store_dir()))
    out["released"] = statefs.release()
print(json.dumps(out))
'''


def _node(tmp_path: Path, img: Path, digest: str, source: str, setup: str = "pass", **env: str) -> dict:
    """Run _NODE in a fresh process as a node of its own: its own state dir and layer cache."""
    node = tmp_path / "node2"
    owner = {k: os.environ[k] for k in ("BUNSHIN_STATE_DIR", "BUNSHIN_CACHE_DIR")}
    full = dict(os.environ, BUNSHIN_STATE_DIR=str(node / "state"), BUNSHIN_CACHE_DIR=str(node / "cache"),
                BUNSHIN_OWNER_WATCH="0", PYTHONPATH=f"{os.environ.get('PYTHONPATH', '')}:{ROOT}", **env)
    code = _NODE.replace("SOURCE", source).replace("SETUP", setup)
    r = subprocess.run([sys.executable, "-c", code, str(img), digest, json.dumps(owner)], capture_output=True,
                       text=True, timeout=240, env=full)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["released"], out  # no workspace left on the other node, its state unmounted
    assert not any((node / "state").iterdir())
    return out


def _check_kids(out: dict) -> None:
    for i in range(2):  # the process's own answer, the image's files (a whiteout too), the layer's owners
        assert out[f"kid{i}"].splitlines() == [f"42 kid{i}", "travelled", "passwd", "travel", "4755 0"], out


def test_load_on_a_node_that_never_saw_the_layer_from_a_shared_store(no_leaks, cache, tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    monkeypatch.setenv("BUNSHIN_LAYER_STORE", str(shared))  # save puts the layer there
    img, digest = _saved(tmp_path)
    assert (shared / digest).is_dir()
    out = _node(tmp_path, img, digest, "None", BUNSHIN_LAYER_STORE=str(shared))
    _check_kids(out)
    assert out["stored"] and out["store"] == [digest]


def test_load_with_a_callable_streaming_from_the_owner(no_leaks, cache, tmp_path):
    img, digest = _saved(tmp_path)
    out = _node(tmp_path, img, digest, "owner")
    _check_kids(out)
    assert out["stored"] and out["store"] == [digest]


def test_pack_unpack_round_trip(no_leaks, cache, tmp_path):
    img, digest = _saved(tmp_path)
    stream = tmp_path / "stream"
    with open(stream, "wb") as f:
        for chunk in criu.pack(img, layers=[digest]):
            assert len(chunk) <= (1 << 20) + 9  # one chunk in memory, whatever the layer weighs
            f.write(chunk)
    # the receiver reads it in pieces cut anywhere, unpacks, and needs nothing more
    setup = ("def pieces():\n"
             "        with open(sys.argv[1] + '.stream', 'rb') as f:\n"
             "            while b := f.read(77777): yield b\n"
             "    got = criu.unpack(pieces(), img + '.unpacked'); img += '.unpacked'\n"
             "    out['received'] = got; out['missing'] = criu.missing_layers(img)")
    os.rename(stream, str(img) + ".stream")
    out = _node(tmp_path, img, digest, "None", setup=setup)
    assert out["received"] == [digest] and out["missing"] == []
    _check_kids(out)


def test_a_cut_stream_is_refused_and_leaves_nothing(no_leaks, cache, tmp_path):
    img, digest = _saved(tmp_path)
    data = b"".join(criu.pack(img))
    dest = tmp_path / "dest"
    with pytest.raises(bunshin.errors.ImageError, match="cut short"):
        criu.unpack([data[: len(data) // 2]], dest)
    assert not dest.exists()


def test_a_corrupt_layer_is_refused_by_digest(no_leaks, cache, tmp_path):
    shared = tmp_path / "shared"
    img, digest = _saved(tmp_path)
    layerstore.publish(digest, shared)
    (shared / digest / "etc" / "passwd").write_bytes(b"root:x:0:0::/root:/bin/evil\n")
    out = _node(tmp_path, img, digest, repr(str(shared)))
    kind, msg = out["error"]
    assert kind == "LayerCorrupt" and digest in msg and str(shared) in msg, msg
    assert out["store"] == []  # nothing of it kept


def test_a_layer_missing_everywhere_is_refused_by_name(no_leaks, cache, tmp_path):
    img, digest = _saved(tmp_path)
    empty = tmp_path / "empty-store"
    empty.mkdir()
    out = _node(tmp_path, img, digest, repr(str(empty)))
    kind, msg = out["error"]
    assert kind == "LayerMissing" and digest in msg and str(empty) in msg and "this node's store" in msg, msg


def test_the_layer_digest_is_kept_beside_a_cached_layer(no_leaks, cache, tmp_path):
    img, digest = _saved(tmp_path)
    [layer] = [p for p in (cache / "layers").iterdir() if p.is_dir()]
    assert layerstore.local(digest) is not None  # this one, or one of the same content
    assert layerstore.tree_digest(layer) == digest
    side = layer.with_name(f".{layer.name}.digest")
    assert json.loads(side.read_text())["digest"] == digest
    side.write_text(json.dumps({**json.loads(side.read_text()), "digest": "0" * 64}))
    assert layerstore.digest_of(layer) == "0" * 64  # read, not recomputed


def test_the_digest_covers_owners_modes_xattrs_and_whiteouts(tmp_path):
    a = tmp_path / "a"
    (a / "d").mkdir(parents=True)
    (a / "d" / "f").write_bytes(b"x")
    base = layerstore.tree_digest(a)
    changes = [lambda: os.chown(a / "d" / "f", 5, 5), lambda: os.chmod(a / "d", 0o700),
               lambda: os.setxattr(a / "d", "trusted.overlay.opaque", b"y"),
               lambda: os.mknod(a / "d" / "gone", 0o020000, os.makedev(0, 0)),
               lambda: (a / "d" / "f").write_bytes(b"y")]
    seen = {base}
    for change in changes:
        change()
        seen.add(layerstore.tree_digest(a))
    assert len(seen) == len(changes) + 1
    os.utime(a / "d" / "f", (1, 1))
    assert layerstore.tree_digest(a) in seen  # times are not content


def test_a_host_image_is_refused_on_another_host_system(family, tmp_path):
    with bunshin.Workspace.create() as ws:
        ws.run("echo hostview > /tmp/mark")
        tpl = ws.snapshot()
        try:
            tpl.save(tmp_path / "img")
        finally:
            tpl.close()
    meta_file = tmp_path / "img" / "meta.json"
    meta = json.loads(meta_file.read_text())
    [base] = meta["bases"]
    assert base["host"]["os_release"] and base["host"]["packages"]
    loaded = bunshin.Template.load(tmp_path / "img")  # the same host: loads
    try:
        kid = loaded.fork(1)[0]
        family.append(kid)
        assert kid.read_file("/tmp/mark") == b"hostview\n"
    finally:
        loaded.close()
    base["host"]["packages"] = "0" * 64
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ForeignHost, match="installed packages"):
        bunshin.Template.load(tmp_path / "img")


def test_a_version_1_image_with_lowers_by_path_still_loads(family, cache, tmp_path):
    img, digest = _saved(tmp_path)
    meta_file = img / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["bases"]
    meta.update(version=1, rootfs_lowers=[str(layerstore.local(digest))])
    meta_file.write_text(json.dumps(meta))
    loaded = bunshin.Template.load(img)
    try:
        kid = loaded.fork(1)[0]
        family.append(kid)
    finally:
        loaded.close()
    assert _answer(kid, "old") == "42 old"
    assert kid.read_file("/etc/travel") == b"travelled\n"


def test_a_fetch_passes_over_a_dead_link_and_a_source_without_the_layer(no_leaks, cache, tmp_path):
    """A store link whose local layer was removed (a cache entry gone) is replaced by the fetched
    copy; a callable source that lacks the layer (``layer_chunks`` raises LayerMissing) lets the
    next source try."""
    import shutil

    layer = tmp_path / "layer"
    (layer / "etc").mkdir(parents=True)
    (layer / "etc" / "mark").write_text(f"{tmp_path.name}\n")  # unique: no other test's digest
    digest = layerstore.tree_digest(layer)
    gone = tmp_path / "gone"
    shutil.copytree(layer, gone)
    layerstore.register(gone, digest)
    shutil.rmtree(gone)
    assert layerstore.local(digest) is None
    shared = tmp_path / "shared"
    shutil.copytree(layer, shared / digest)
    got = layerstore.fetch(digest, [layerstore.layer_chunks, shared])
    assert (got / "etc" / "mark").read_text() == f"{tmp_path.name}\n"
    assert layerstore.local(digest) == got
