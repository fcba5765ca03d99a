"""Fidelity suite: one small C program per kind of process state (tests/fidelity/victims/*.c)
sets its state up in a workspace, says READY and, on SIGTERM, checks every property of it and
writes PASS or what differs (victim.h). Each is checked in the child and in the source after
``ws.fork()``, after ``ws.snapshot()`` + ``tpl.fork(1)``, after ``bunshin.criu`` dump and
restore by a stock CRIU (the reference: Debian's, without Bunshin's patch), by Bunshin's patched
CRIU (the default), and after a dump and ``bunshin.criu.restore_many`` (clones of one image
sharing its memory: a restore, then forks). A fork may refuse a state with ForkError instead: that is an outcome
too. The outcomes go to a JSON file (``BUNSHIN_FIDELITY_OUT``, else fidelity.json in pytest's
temporary directory) from which ``python3 -m tests.fidelity.table`` fills docs/fork-table.md."""

from __future__ import annotations

import json
import os
import platform
import signal
import struct
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import bunshin
from bunshin.errors import BunshinError, CheckpointError, CriuError, ForkError, ImageError

HERE = Path(__file__).parent
SOURCES = sorted((HERE / "victims").glob("*.c"))
VICTIMS = [p.stem for p in SOURCES]
PATHS = ("ws_fork", "tpl_fork", "criu_stock", "criu", "criu_shared")
READY_TIMEOUT = 15.0
VERDICT_TIMEOUT = 10.0

# Children that fail today, each a bug of the fork engine the suite found (a silent mismatch):
# expected to fail until fixed, not hidden (their verdicts are in the JSON and the table).
_KNOWN: dict[str, str] = {
}
_FLAT = {  # a flat tree's, without the module (fork/tree.py makes them exact: EXACT_TREE below)
    "ctty": "a process that is not its session's leader loses the controlling terminal (ENXIO)",
    "tree": ("a flat tree: every process is a child of the child's init (its getppid, wait() for "
             "a live child and session differ; zombies and PDEATHSIG are carried)"),
}
if os.environ.get("BUNSHIN_KMOD") == "1":  # REPARENT and JOIN_SESSION make the tree and sessions
    _KNOWN["ctty"] = _FLAT["ctty"]
elif os.environ.get("BUNSHIN_TREE", "").strip().lower() == "flat":
    _KNOWN.update(_FLAT)
KNOWN_CHILD_FAILS: dict[tuple[str, str], str] = {
    (victim, path): why for victim, why in _KNOWN.items() for path in ("ws_fork", "tpl_fork")}

# Classes a fork must carry (PASS in the child), not refuse: a process under another uid is
# transplanted where it cannot clone itself into the child (fork/transplant.py).
CARRIED = {"setuid"}

# Victims run under another uid from their start (setpriv, as a daemon that dropped root): on a
# stock kernel each is transplanted, so their classes show what a transplant carries.
UNDER_ANOTHER_UID = ["altstack", "deadlines", "deleted_mapped", "epoll_closed", "eventfds", "fifo", "inotify_deleted",
                     "itimer", "locks", "madvise", "memfd", "opath", "pipe", "procattrs", "ptimer",
                     "robust", "rseq", "shared_files", "shmem", "sighandlers", "sockopts", "stopped", "tcp",
                     "threads", "timer_thread", "udp", "unix_stream"]
RUN_AS_1001 = ("setpriv", "--reuid=1001", "--regid=1001", "--clear-groups")
# Classes a transplant refuses up front (ForkError naming this): its threads take the process's
# uid after every fixup, which clears what each set (parent_death.py).
REFUSED_UNDER_ANOTHER_UID = {"pdeath_thread": "parent-death signal"}
# Victims that check times against the fork's duration (a blocked call's deadline, CPU timers):
# a transplant copies memory, which the QEMU guest (TCG) makes take longer than their tolerance.
TIMED = {"deadline_main", "deadlines", "itimer"}
HELD = 1.0  # seconds a template is held between its snapshot and its fork

# Children a fork refuses up front (ForkError naming this), as no system call could make the
# state again: two processes sharing a kernel object through clone()'s flags (plan.SHARINGS).
REFUSED_CHILDREN = {"clone_files": "CLONE_FILES", "clone_fs": "CLONE_FS", "clone_sighand": "CLONE_SIGHAND",
                    "clone_sysvsem": "CLONE_SYSVSEM", "clone_vm": "CLONE_VM"}

RESULTS: dict[str, dict] = {}


def title(source: Path) -> str:
    """The class a victim checks: its opening comment, ``/* fidelity: TITLE */``."""
    head = source.read_text().split("*/", 1)[0].removeprefix("/* fidelity:")
    return " ".join(w.strip("* ") for w in head.split() if w.strip("* "))


@pytest.fixture(scope="session")
def binaries(tmp_path_factory) -> dict[str, Path]:
    """Every victim compiled once (in parallel), by name."""
    out = tmp_path_factory.mktemp("fidelity-bin")

    def build(src: Path) -> tuple[str, Path, str]:
        exe = out / src.stem
        r = subprocess.run(["cc", "-O1", "-Wall", "-Werror", "-pthread", "-o", str(exe), str(src)],
                           capture_output=True, text=True, timeout=120)
        return src.stem, exe, r.stderr if r.returncode else ""

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        built = list(pool.map(build, SOURCES))
    errors = {name: err for name, _exe, err in built if err}
    assert not errors, f"victims that do not compile: {errors}"
    return {name: exe for name, exe, _err in built}


@pytest.fixture(scope="session", autouse=True)
def results_file(tmp_path_factory):
    """Writes RESULTS once every test has run."""
    yield
    if not RESULTS:
        return
    path = Path(os.environ.get("BUNSHIN_FIDELITY_OUT") or tmp_path_factory.getbasetemp() / "fidelity.json")
    doc = {"kernel": platform.release(), "module": os.environ.get("BUNSHIN_KMOD") == "1",
           "victims": {name: {"title": title(HERE / "victims" / f"{name}.c"), **RESULTS[name]}
                       for name in sorted(RESULTS)}}
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def _stock_criu() -> str | None:
    """A stock CRIU besides Bunshin's patched one: the private install `bunshin criu provision`
    makes first (the patched build takes pycriu from it), or None."""
    from bunshin.criu_locate import private_prefix

    path = private_prefix() / "bin" / "criu"
    return str(path) if path.is_file() else None


def _criu_usable() -> str:
    """Why bunshin.criu cannot run here, or "" if it can."""
    try:
        from bunshin.criu import runner

        runner.criu()
    except CriuError as e:
        return str(e)
    return ""


def _read(w, path: str) -> bytes | None:
    try:
        return w.read_file(path)
    except BunshinError:
        return None


class NeverReady(Exception):
    """The victim could not set its state up (its own failure, not the fork's)."""


def _start(family, exe: Path, run_as: tuple[str, ...] = ()):
    """A new workspace running the victim (through ``run_as``, a command that execs it), once
    it is READY; its pid there."""
    ws = bunshin.Workspace.create()
    family.append(ws)
    ws.write_file("/fid/victim", exe.read_bytes(), mode=0o755)
    pid = ws.spawn([*run_as, "/fid/victim"], cwd="/tmp", log_path="/tmp/fid-log")
    deadline = time.monotonic() + READY_TIMEOUT
    while _read(ws, "/tmp/fid-ready") is None:
        if time.monotonic() > deadline or ws.wait(pid, 0.001) is not None:
            log = (_read(ws, "/tmp/fid-log") or b"").decode(errors="replace")
            raise NeverReady(f"{exe.name} never became ready: {log}".strip())
        time.sleep(0.02)
    return ws, pid


def _host_pid(w, pid: int) -> int:
    """The host pid of ``pid``, a pid inside ``w``."""
    for host in w.host_pids():
        with open(f"/proc/{host}/status") as f:
            ns = next(ln.split()[-1] for ln in f if ln.startswith("NSpid:"))
        if int(ns) == pid:
            return host
    raise LookupError(f"no process {pid} in {w.id}")


def _frames(host_pid: int, at: int, pages: int) -> list[int]:
    with open(f"/proc/{host_pid}/pagemap", "rb", buffering=0) as f:
        f.seek(at // 4096 * 8)
        raw = f.read(pages * 8)
    return [e & ((1 << 55) - 1) for e in struct.unpack(f"{pages}Q", raw)]


def _cow_frames(w, pid: int) -> list[str]:
    """cow.c's pages, read from the host (a sandbox's processes see no frame numbers): the
    victim and its child process still map the same frames."""
    at, kid = (_read(w, "/tmp/fid-cow") or b"0 0").split()
    mine, theirs = (_frames(_host_pid(w, p), int(at, 16), 64) for p in (pid, int(kid)))
    shared = sum(1 for a, b in zip(mine, theirs) if a and a == b)
    return [] if shared == 64 else [f"pages still shared with the child process (host's pagemap): {shared}, want 64"]


# Victims whose state is also checked from the host, before the victim checks its own: what
# their processes may not read in a sandbox
HOST_CHECKS = {"cow": _cow_frames}


def verdict(w, pid: int, victim: str = "") -> dict:
    """SIGTERM the victim in ``w`` and take what it reports (bounded: never waits forever),
    after what the host checks of it."""
    host = HOST_CHECKS[victim](w, pid) if victim in HOST_CHECKS else []
    try:
        w.kill(pid, signal.SIGTERM)
    except BunshinError as e:
        return {"outcome": "FAIL", "detail": f"the victim is gone: {e}"}
    deadline = time.monotonic() + VERDICT_TIMEOUT
    while (got := _read(w, "/tmp/fid-verdict")) is None:
        if time.monotonic() > deadline:
            log = (_read(w, "/tmp/fid-log") or b"").decode(errors="replace")
            return {"outcome": "FAIL", "detail": f"no verdict within {VERDICT_TIMEOUT:.0f} s {log}".strip()}
        time.sleep(0.02)
    text = "\n".join([*host, got.decode(errors="replace").strip()])
    return {"outcome": "PASS" if text == "PASS" else "FAIL", "detail": "" if text == "PASS" else text}


def _line(detail: str) -> str:
    """A verdict on one line, for pytest's summary."""
    return "; ".join(detail.splitlines())


def tasks(ws) -> dict[int, int]:
    """Host pid -> start time (field 22 of /proc/PID/stat) of every process of ``ws``."""
    out = {}
    for pid in ws.host_pids():
        try:
            st = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            continue
        out[pid] = int(st[st.rindex(b")") + 2:].split()[19])
    return out


def _child(ws, path: str, tmp_path: Path):
    """The copy ``path`` makes of ``ws``; raises what refuses it."""
    if path == "ws_fork":
        return ws.fork(1)[0]
    if path == "tpl_fork":
        tpl = ws.snapshot()
        try:
            return tpl.fork(1)[0]
        finally:
            tpl.close()
    from bunshin import criu

    criu.dump_workspace(ws, tmp_path / "img")
    if path == "criu_shared":
        first, second = criu.restore_many(tmp_path / "img", 2)
        second.close()
        return first
    return criu.restore_workspace(tmp_path / "img")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("victim", VICTIMS)
def test_fidelity(victim, path, binaries, family, tmp_path, monkeypatch):
    if path == "criu_stock":
        if (stock := _stock_criu()) is None:
            RESULTS.setdefault(victim, {})[path] = {"child": {"outcome": "NOT RUN", "detail": "no stock CRIU"}}
            pytest.skip("no private stock CRIU (`bunshin criu provision`)")
        monkeypatch.setenv("BUNSHIN_CRIU", stock)
    if path.startswith("criu") and (why := _criu_usable()):
        RESULTS.setdefault(victim, {})[path] = {"child": {"outcome": "NOT RUN", "detail": why}}
        pytest.skip(f"no usable CRIU: {why}")
    try:
        ws, pid = _start(family, binaries[victim])
    except NeverReady as e:
        failed = {"outcome": "FAIL", "detail": str(e)}
        RESULTS.setdefault(victim, {})[path] = {"child": failed, "source": failed, "same_tasks": True}
        pytest.fail(str(e))
    before, init = tasks(ws), ws.init_pid
    # what CRIU says it cannot dump or restore is its refusal; a fork's is ForkError alone
    refusal: tuple[type[Exception], ...] = (
        (CriuError, CheckpointError, ImageError, ForkError) if path.startswith("criu") else (ForkError,))
    try:
        kid = _child(ws, path, tmp_path)
    except refusal as e:
        child = {"outcome": "REFUSED", "detail": str(e)}
    else:
        family.append(kid)
        child = verdict(kid, pid, victim)
    after = tasks(ws)
    source = verdict(ws, pid, victim)
    same = after == before
    RESULTS.setdefault(victim, {})[path] = {"child": child, "source": source, "same_tasks": same}
    if path == "criu_stock":
        return  # the reference: recorded, whatever it says
    if path in ("criu", "criu_shared"):
        # as on stock CRIU (run just before, in this session): a fork may refuse besides
        stock = RESULTS[victim].get("criu_stock", {})
        if child["outcome"] == "FAIL" and stock.get("child", {}).get("outcome") == "FAIL":
            pytest.xfail(f"fails on stock CRIU too: {_line(child['detail'])}")
        if child["outcome"] == "FAIL" and victim in TIMED:
            # one CRIU, two runs: a dump and restore that outlast the class's tolerance on a
            # loaded machine fail it on either, by chance
            pytest.xfail(f"a timed class after a dump and restore: {_line(child['detail'])}")
        if path == "criu" and stock.get("child", {}).get("outcome") in ("PASS", "REFUSED"):
            assert child["outcome"] == stock["child"]["outcome"], (
                f"the patched CRIU differs from the stock one: {child['detail']}")
        assert child["outcome"] != "FAIL", f"silent mismatch after a {path} restore: {child['detail']}"
        if stock.get("source", {}).get("outcome", "PASS") == "PASS":
            assert source["outcome"] == "PASS", f"the source changed: {source['detail']}"
        return
    if victim in REFUSED_CHILDREN:
        assert child["outcome"] == "REFUSED" and REFUSED_CHILDREN[victim] in child["detail"], child
    if victim in CARRIED:
        assert child["outcome"] == "PASS", child
    # The old engine re-clones the whole source (its init included) at every fork: what the
    # source then loses is that design's, not a silent mismatch of this class.
    recloned = not same and init not in after
    if child["outcome"] == "FAIL":
        if (victim, path) in KNOWN_CHILD_FAILS:
            pytest.xfail(f"{KNOWN_CHILD_FAILS[victim, path]}: {_line(child['detail'])}")
        pytest.fail(f"silent mismatch in the child: {child['detail']}")
    if source["outcome"] != "PASS" and recloned:
        pytest.xfail(f"the source was re-cloned and lost: {_line(source['detail'])}")
    assert source["outcome"] == "PASS", f"the source changed: {source['detail']}"
    if not same and recloned:
        pytest.xfail("the source was re-cloned: its tasks are new ones")
    assert same, f"the source's tasks changed: before {before}, after {after}"


@pytest.mark.parametrize("path", ("ws_fork", "tpl_fork"))
@pytest.mark.parametrize("victim", UNDER_ANOTHER_UID)
def test_fidelity_under_another_uid(victim, path, binaries, family, tmp_path):
    """Not recorded in the table: its rows are the victims as root."""
    ws, pid = _start(family, binaries[victim], RUN_AS_1001)
    # Uid and Gid lines, as the workspace names them (the trainer reads a sandbox's shifted)
    assert ws.run(f"cat /proc/{pid}/status").stdout.count(b"\t1001") >= 4
    before = tasks(ws)
    try:
        kid = _child(ws, path, tmp_path)
    except ForkError as e:
        pytest.fail(f"refused: {e}")
    else:
        family.append(kid)
        child = verdict(kid, pid)
        if child["outcome"] == "FAIL" and (victim, path) in KNOWN_CHILD_FAILS:
            pytest.xfail(f"{KNOWN_CHILD_FAILS[victim, path]}: {_line(child['detail'])}")
        if child["outcome"] == "FAIL" and victim in TIMED and os.environ.get("BUNSHIN_KMOD") == "1":
            pytest.xfail(f"a transplant in the QEMU guest outlasts the victim's tolerance: {_line(child['detail'])}")
        assert child["outcome"] == "PASS", child
    assert tasks(ws) == before
    source = verdict(ws, pid)
    assert source["outcome"] == "PASS", source


@pytest.mark.parametrize("path", ("ws_fork", "tpl_fork"))
@pytest.mark.parametrize("victim", sorted(REFUSED_UNDER_ANOTHER_UID))
def test_fidelity_refused_under_another_uid(victim, path, binaries, family, tmp_path):
    ws, pid = _start(family, binaries[victim], RUN_AS_1001)
    before = tasks(ws)
    with pytest.raises(ForkError, match=REFUSED_UNDER_ANOTHER_UID[victim]) as e:
        family.append(_child(ws, path, tmp_path))
    assert f"process {pid} " in str(e.value) and "thread " in str(e.value), e.value
    assert tasks(ws) == before
    source = verdict(ws, pid)
    assert source["outcome"] == "PASS", source


@pytest.mark.parametrize("victim", sorted(TIMED))
def test_fidelity_of_a_template_forked_long_after_its_snapshot(victim, binaries, family):
    """Not recorded in the table: a template's clone wakes at its source's deadlines however
    long the template was held (the time left its calls took at the snapshot counts down)."""
    ws, pid = _start(family, binaries[victim])
    tpl = ws.snapshot()
    try:
        time.sleep(HELD)
        (kid,) = tpl.fork(1)
        family.append(kid)
    finally:
        tpl.close()
    child = verdict(kid, pid)
    source = verdict(ws, pid)
    assert source["outcome"] == "PASS", source
    lines = [ln for ln in child.get("detail", "").splitlines() if ln.strip()]
    if child["outcome"] == "FAIL" and lines and all(ln.startswith("timed condition wait") for ln in lines):
        # seen once in several CI runs: a recreated thread's absolute futex wait woke late by
        # the time the template was held (docs/fork-table.md, deviations); not understood yet
        pytest.xfail(f"a recreated thread's timed condition wait woke late: {_line(child['detail'])}")
    assert child["outcome"] == "PASS", child


# Classes a stock kernel's exact tree (fork/tree.py; BUNSHIN_TREE=flat turns it off) carries, in
# both fork paths, whatever the environment says; not recorded in the table.
EXACT_TREE = ["ctty", "ctty_held", "tree"]


@pytest.mark.parametrize("path", ("ws_fork", "tpl_fork"))
@pytest.mark.parametrize("victim", EXACT_TREE)
def test_fidelity_in_an_exact_tree(victim, path, binaries, family, tmp_path, monkeypatch):
    from bunshin.fork.cloners import cloner

    monkeypatch.setenv("BUNSHIN_TREE", "exact")
    if not cloner().exact_tree():
        pytest.skip("the module's backend makes the tree itself")
    ws, pid = _start(family, binaries[victim])
    before = tasks(ws)
    kid = _child(ws, path, tmp_path)
    family.append(kid)
    child = verdict(kid, pid)
    assert child["outcome"] == "PASS", child
    assert tasks(ws) == before
    source = verdict(ws, pid)
    assert source["outcome"] == "PASS", source


def test_a_source_held_long_by_a_fork_wakes_at_its_deadlines(binaries, family, monkeypatch):
    """Not recorded in the table: a fork that holds the source frozen for 1 s (a slow copy of
    its files) leaves its select, pselect and ppoll their deadlines, in the source and the
    child (the freezer made them write their time left; it counts down from the freeze)."""
    from bunshin.fork import template

    real = template._copy_upper

    def slow(*args, **kw):
        time.sleep(HELD)
        return real(*args, **kw)

    monkeypatch.setattr(template, "_copy_upper", slow)
    ws, pid = _start(family, binaries["deadline_main"])
    (kid,) = ws.fork(1)
    family.append(kid)
    for w in (kid, ws):
        got = verdict(w, pid)
        assert got["outcome"] == "PASS", got
