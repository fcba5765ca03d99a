"""CRIU ≥ 4 integration (bunshin.criu): real workspaces dumped and restored with real bash and
Python processes; images are checked never to change on a failed restore."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import pytest

import bunshin
from bunshin.errors import CheckpointError, CriuError, ImageError

try:
    from bunshin.criu import runner as _runner

    _INFO = _runner.criu()
except CriuError as e:  # no CRIU >= 4 here: say why, run nothing
    pytest.skip(f"no usable CRIU >= 4 ({e}); `python3 -m bunshin criu provision` installs one",
                allow_module_level=True)

from conftest import wait_for_bytes
from fake_criu import fake_criu

from bunshin import criu


def _tree_digest(path: Path) -> dict[str, str]:
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[str(p.relative_to(path))] = hashlib.sha256(p.read_bytes()).hexdigest()
        elif p.is_dir():
            out[str(p.relative_to(path)) + "/"] = oct(p.stat().st_mode)
    return out


def _busy_workspace() -> tuple[bunshin.Workspace, dict]:
    """A workspace with a shell (cwd, variables, a function, history), a Python REPL holding a
    variable (on a FIFO), a background server and files; returns it and what to expect."""
    ws = bunshin.Workspace.create(memory_limit="1G", pids_limit=256, env={"ROLE": "agent"})
    sh = ws.shell()
    sh.run("set -o history; cd /tmp && X=42 && greet() { echo hi $1; } && umask 027")
    sh.run("echo first-command-in-history")
    ws.write_file("/repo/a.py", "print('from a file')\n")
    ws.run("mkdir -p /work && echo data > /work/state.txt && rm -f /etc/hostname.nope")
    ws.run("mkfifo /tmp/in")
    repl = ws.spawn(["sh", "-c", "exec python3 -i -q -u < /tmp/in > /tmp/out 2>&1"])
    ws.spawn(["sh", "-c", "exec sleep 100000 > /tmp/in"])  # a writer: the REPL sees no EOF
    ws.run("echo 'x = 41' > /tmp/in")
    assert b">>> " in wait_for_bytes(ws, "/tmp/out", b">>> ")
    srv = ws.spawn(["python3", "-c", "import time\nwhile True: time.sleep(0.05)"])
    expect = {
        "procs": {p.pid: p.cmdline for p in ws.processes()},
        "history": sh.run("history").stdout.decode().splitlines(),
        "repl": repl,
        "srv": srv,
    }
    return ws, expect


def _check_state(w, expect: dict, tag: str) -> None:
    assert {p.pid: p.cmdline for p in w.processes()} == expect["procs"]
    assert len(w.shells) == 1
    sh = w.shells[0]
    r = sh.run("echo $X $PWD; greet you; umask")
    assert r.stdout.decode().splitlines() == ["42 /tmp", "hi you", "0027"], r
    hist = sh.run("history").stdout.decode().splitlines()
    assert any("first-command-in-history" in ln for ln in hist)
    assert hist[: len(expect["history"])] == expect["history"]
    assert w.read_file("/repo/a.py") == b"print('from a file')\n"
    assert w.run("cat /work/state.txt").stdout == b"data\n"
    assert w.run("echo $ROLE").stdout == b"agent\n"  # the workspace's config came along
    assert w.run(f"kill -0 {expect['srv']} && echo alive").stdout == b"alive\n"
    w.run(f"echo 'print(\"{tag}\", x + 1)' > /tmp/in")
    out = wait_for_bytes(w, "/tmp/out", f"{tag} 42".encode())
    assert f"{tag} 42".encode() in out, out


def test_round_trip_keeps_processes_pids_files_shell_and_repl(family, tmp_path):
    ws, expect = _busy_workspace()
    family.append(ws)
    meta = criu.dump_workspace(ws, tmp_path / "img")
    assert meta["processes"] == len(expect["procs"]) and meta["layers"] == 1
    # the original continues, unchanged
    _check_state(ws, expect, "original")
    ws.close()
    # restored after the original is gone; twice from the same images, independent clones
    a = criu.restore_workspace(tmp_path / "img")
    family.append(a)
    b = criu.restore_workspace(tmp_path / "img")
    family.append(b)
    # (the closed original's namespace number may be handed out again: compare with ours)
    ns = {os.readlink(f"/proc/{w.init_pid}/ns/pid") for w in (a, b)}
    assert len(ns) == 2 and os.readlink("/proc/self/ns/pid") not in ns
    _check_state(a, expect, "clone-a")
    a.write_file("/work/state.txt", "changed in a\n")
    _check_state(b, expect, "clone-b")  # a's edits are not b's
    # a restored workspace is a full workspace: new shells, exec, spawn, fork
    assert a.shell().run("echo new $((6*7))").stdout == b"new 42\n"
    assert a.exec(["python3", "-c", "print('ok')"]).stdout == b"ok\n"
    (kid,) = a.fork(1)
    family.append(kid)
    assert kid.read_file("/work/state.txt") == b"changed in a\n"
    assert kid.shells[0].run("echo $X").stdout == b"42\n"


def test_close_cleans_everything_and_a_restore_can_be_repeated(no_leaks, tmp_path):
    with bunshin.Workspace.create() as ws:
        ws.run("echo 1 > /tmp/n")
        criu.dump_workspace(ws, tmp_path / "img")
    before = _tree_digest(tmp_path / "img")
    for i in range(3):
        w = criu.restore_workspace(tmp_path / "img")
        assert w.run("cat /tmp/n").stdout == b"1\n"
        w.run(f"echo {i} > /tmp/n")
        w.close()
        with pytest.raises(bunshin.WorkspaceClosed):
            w.run("true")
    assert _tree_digest(tmp_path / "img") == before  # restores only read the images


def test_concurrent_restores_from_threads(family, tmp_path):
    with bunshin.Workspace.create() as ws:
        ws.shell().run("Y=ok")
        criu.dump_workspace(ws, tmp_path / "img")
    got: list = []
    errs: list = []

    def one() -> None:
        try:
            got.append(criu.restore_workspace(tmp_path / "img"))
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    family.extend(got)
    assert not errs, errs
    assert len({w.init_pid for w in got}) == 3
    for w in got:
        assert w.shells[0].run("echo $Y").stdout == b"ok\n"


def test_template_save_load_fork(family, tmp_path):
    ws, expect = _busy_workspace()
    family.append(ws)
    tpl = ws.snapshot()
    tpl.save(tmp_path / "tpl")
    tpl.close()
    ws.close()
    family.remove(ws)
    loaded = bunshin.Template.load(tmp_path / "tpl")
    try:
        kids = loaded.fork(2)
    finally:
        loaded.close()  # the children keep the frozen state alive
    family.extend(kids)
    for i, k in enumerate(kids):
        _check_state(k, expect, f"kid-{i}")
    u = bunshin.memory.family_usage(kids)
    assert u.shared_bytes > 1 << 20  # forks of the loaded template share its memory


@pytest.fixture
def ksm_run():
    """Puts /sys/kernel/mm/ksm/run back as it was (restore_workspace(ksm=True) starts KSM)."""
    p = Path("/sys/kernel/mm/ksm/run")
    before = p.read_text().strip()
    yield
    p.write_text(before)


def test_ksm_marks_restored_processes_mergeable(family, ksm_run, tmp_path):
    with bunshin.Workspace.create() as ws:
        ws.spawn(["python3", "-c", "import time\nb = bytearray(8 << 20)\nwhile True: time.sleep(1)"])
        criu.dump_workspace(ws, tmp_path / "img")
    w = criu.restore_workspace(tmp_path / "img", ksm=True)
    family.append(w)
    assert Path("/sys/kernel/mm/ksm/run").read_text().strip() == "1"
    for pid in w.host_pids():
        stat = Path(f"/proc/{pid}/ksm_stat").read_text()
        assert "ksm_merge_any: yes" in stat, (pid, stat)
    plain = criu.restore_workspace(tmp_path / "img")
    family.append(plain)
    assert all("ksm_merge_any: no" in Path(f"/proc/{p}/ksm_stat").read_text() for p in plain.host_pids())


# -- errors ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def image(tmp_path_factory):
    path = tmp_path_factory.mktemp("criu") / "img"
    with bunshin.Workspace.create() as ws:
        ws.spawn(["sleep", "100000"])
        criu.dump_workspace(ws, path)
    return path


def _copy(src: Path, dst: Path) -> Path:
    import subprocess

    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)  # layers hold whiteout devices
    return dst


def test_missing_images(no_leaks, tmp_path):
    with pytest.raises(ImageError, match="no such image directory"):
        criu.restore_workspace(tmp_path / "nope")
    with pytest.raises(ImageError, match="no such image directory"):
        bunshin.Template.load(tmp_path / "nope")


def test_foreign_images(no_leaks, tmp_path):
    (tmp_path / "pstree.img").write_bytes(b"\0" * 64)
    before = _tree_digest(tmp_path)
    with pytest.raises(ImageError, match="not a Bunshin workspace image"):
        criu.restore_workspace(tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps({"format": "docker"}))
    with pytest.raises(ImageError, match="not a Bunshin"):
        criu.restore_workspace(tmp_path)
    (tmp_path / "meta.json").unlink()
    assert _tree_digest(tmp_path) == before


def test_corrupt_images_are_refused_and_left_alone(no_leaks, image, tmp_path):
    bad = _copy(image, tmp_path / "bad")
    core = next((bad / "criu").glob("core-*.img"))
    data = bytearray(core.read_bytes())
    data[len(data) // 2] ^= 0xFF
    core.write_bytes(bytes(data))
    before = _tree_digest(bad)
    with pytest.raises(ImageError, match="checksum"):
        criu.restore_workspace(bad)
    assert _tree_digest(bad) == before
    pages = next((bad / "criu").glob("pages-*.img"))
    with open(pages, "r+b") as fh:
        fh.truncate(pages.stat().st_size - 4096)
    before = _tree_digest(bad)
    with pytest.raises(ImageError, match="corrupt"):
        criu.restore_workspace(bad)
    assert _tree_digest(bad) == before
    (bad / "meta.json").write_text("{not json")
    with pytest.raises(ImageError, match="corrupt metadata"):
        criu.restore_workspace(bad)


def test_a_failing_criu_restore_leaves_images_untouched(no_leaks, image, tmp_path):
    # An image CRIU itself refuses (pstree garbled, its checksum updated so that our own check
    # passes): CheckpointError with CRIU's reasons, and not one byte of the images changes.
    bad = _copy(image, tmp_path / "bad")
    pstree = bad / "criu" / "pstree.img"
    pstree.write_bytes(pstree.read_bytes()[:8] + b"\xff" * 24)
    from bunshin.criu import images

    meta = json.loads((bad / "meta.json").read_text())
    meta["files"] = images.inventory(bad)
    (bad / "meta.json").write_text(json.dumps(meta))
    before = _tree_digest(bad)
    with pytest.raises(CheckpointError, match="CRIU restore") as ei:
        criu.restore_workspace(bad)
    assert ei.value.log and Path(ei.value.log).exists()
    os.unlink(ei.value.log)
    assert _tree_digest(bad) == before


def test_dump_refuses_a_non_empty_directory(ws, tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(ImageError, match="not empty"):
        criu.dump_workspace(ws, tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "mine"
    assert ws.run("echo still").stdout == b"still\n"


def test_too_old_criu_is_refused(ws, image, tmp_path, monkeypatch):
    fake = fake_criu(tmp_path / "criu", "3.17")
    monkeypatch.setenv("BUNSHIN_CRIU", str(fake))
    before = _tree_digest(image)
    with pytest.raises(CriuError, match=r"3\.17\.0 .* refused: CRIU 3\.x"):
        criu.restore_workspace(image)
    with pytest.raises(CriuError, match="3.x"):
        criu.dump_workspace(ws, tmp_path / "img")
    assert not (tmp_path / "img").exists()
    assert _tree_digest(image) == before
    assert ws.run("echo fine").stdout == b"fine\n"


# -- prefix-cache spill ------------------------------------------------------------------------
def test_prefix_cache_spills_evicted_states_and_restores_them_on_a_hit(family, tmp_path):
    from bunshin.cache import PrefixCache

    base = bunshin.Workspace.create()
    family.append(base)
    a, b, c = base.fork(3)
    family.extend([a, b, c])
    spill = tmp_path / "spill"
    with PrefixCache(tmp_path / "c.lmdb", memory_budget=1, spill_dir=spill) as cache:
        ca = cache.rollout(a, "t")
        cmd = "cd /tmp && Z=7 && echo x >> /tmp/count && echo one"
        assert ca.call(cmd).stdout.strip() == b"one"
        st = cache.stats
        assert (st.snapshots, st.evictions, st.spills) == (1, 1, 1)
        assert cache.live_states() == [] and cache.spilled_states() == [ca.key]
        assert cache.store.get(ca.key)["template"].startswith("criu:")
        cb = cache.rollout(b, "t")
        assert cb.call(cmd).stdout.strip() == b"one"  # restored from disk, not executed
        st = cache.stats
        assert (st.hits, st.unspills, st.misses) == (1, 1, 1)
        assert b.read_file("/tmp/count") == b"x\n"  # the state a reached, executed once
        assert cb.call("echo $Z $PWD").stdout == b"7 /tmp\n"  # the session's shell came along
        # an explicit spill of a live state
        cc = cache.rollout(c, "t")
        cc.call(cmd)
        with pytest.raises(bunshin.BunshinError, match="no live state"):
            cache.spill(b"\0" * 16)
    assert not spill.exists() or not any(spill.iterdir())  # close() removes what it spilled


_ECHO = """
import signal, socket, sys, time
if sys.argv[1] == "server":
    ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", 7070)); ls.listen(); c, _ = ls.accept()
    while (d := c.recv(100)):
        c.sendall(d.upper())
else:
    for _ in range(200):
        try:
            s = socket.create_connection(("127.0.0.1", 7070)); break
        except OSError:
            time.sleep(0.05)
    s.sendall(b"first"); open("/tmp/got", "wb").write(s.recv(100))
    def again(*_):
        s.sendall(b"second"); open("/tmp/got", "wb").write(s.recv(100))
    signal.signal(signal.SIGUSR1, again)
    while True:
        signal.pause()
"""


def test_tcp_connection_inside_the_workspace(family, tmp_path):
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.write_file("/echo.py", _ECHO)
    ws.spawn(["python3", "/echo.py", "server"])
    client = ws.spawn(["python3", "/echo.py", "client"])
    assert wait_for_bytes(ws, "/tmp/got", b"FIRST") == b"FIRST"
    if _INFO.version < (4, 2, 0):
        # CRIU 4.1 cannot read SO_PASSCRED of inet sockets on Linux >= 6.16: a clear error
        with pytest.raises(CheckpointError, match="criu#2705") as ei:
            criu.dump_workspace(ws, tmp_path / "img")
        assert not (tmp_path / "img").exists()
        assert "Can't get 1:16 opt" in Path(ei.value.log).read_text()  # the log was kept
        os.unlink(ei.value.log)
        assert ws.run("echo alive").stdout == b"alive\n"
        pytest.skip(f"CRIU {_runner.version_string(_INFO)} cannot dump TCP sockets on this kernel "
                    "(fixed in 4.2: `bunshin criu provision`)")
    criu.dump_workspace(ws, tmp_path / "img")
    ws.close()
    w = criu.restore_workspace(tmp_path / "img")
    family.append(w)
    w.kill(client, 10)
    assert wait_for_bytes(w, "/tmp/got", b"SECOND") == b"SECOND"  # the connection continued


def test_a_restored_state_can_be_saved_again(family, tmp_path):
    with bunshin.Workspace.create() as ws:
        ws.shell().run("cd /tmp && V=gen1")
        criu.dump_workspace(ws, tmp_path / "gen1")
    w1 = criu.restore_workspace(tmp_path / "gen1")
    family.append(w1)
    w1.shells[0].run("V=${V}-gen2")
    criu.dump_workspace(w1, tmp_path / "gen2")  # a restored workspace dumps like any other
    assert w1.shells[0].run("echo $V").stdout == b"gen1-gen2\n"
    tpl = bunshin.Template.load(tmp_path / "gen2")
    try:
        tpl.save(tmp_path / "gen3")  # and so does a loaded template
    finally:
        tpl.close()
    w3 = criu.restore_workspace(tmp_path / "gen3")
    family.append(w3)
    assert w3.shells[0].run("echo $V $PWD").stdout == b"gen1-gen2 /tmp\n"
    # layers are not squashed: the restored workspace's upper as the snapshot froze it, and
    # gen2's two (the template's own upper, empty, is left out)
    assert criu.read_meta(tmp_path / "gen3")["layers"] == 3


def test_dump_and_restore_are_symmetric(family, tmp_path):
    """dump(config, body, terminals) -> images; restore(images) -> (config, body, sessions)."""
    ws = bunshin.Workspace.create(memory_limit="96M", env={"ROLE": "agent"}, workdir="/tmp")
    family.append(ws)
    sh = ws.shell()
    sh.run("X=kept")
    ws.cgroup.set_limits(pids_limit=64)  # changed live: the image carries it too
    with ws.steady("wait for them"):
        criu.dump(ws.config, ws.body, ws.terminals(), tmp_path / "img")
    restored = criu.restore(tmp_path / "img")
    w = bunshin.Workspace.from_body(*restored)
    family.append(w)
    assert restored.config == ws.config
    assert restored.body.cgroup.limits == ws.cgroup.limits
    assert [s.id for s in w.shells] == [sh.id]
    assert w.shells[0].run("echo $X $ROLE").stdout == b"kept agent\n"
