"""Every escape attempt of tests/test_escape.py (its tests, imported), from a restored sandbox
workspace, a fork of it and a fork of a template saved from it and loaded: each fails and
leaves the host unchanged, as from a created one."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import bunshin
from bunshin.errors import CriuError

try:
    from bunshin.criu import runner as _runner

    _runner.criu()
except CriuError as e:  # no CRIU >= 4 here: say why, run nothing
    pytest.skip(f"no usable CRIU >= 4 ({e}); `python3 -m bunshin criu provision` installs one",
                allow_module_level=True)

import test_escape

# its attempts (the tests that take a box) and the fixtures they take; where they run (WHERE,
# boxes, box) is defined below
ATTEMPT_TESTS = {n: f for n, f in vars(test_escape).items()
                 if n.startswith("test_") and "box" in inspect.signature(f).parameters}
globals().update({n: v for n, v in vars(test_escape).items() if not n.startswith(("_", "test_"))})
globals().update(ATTEMPT_TESTS)

from bunshin import criu
from bunshin.runtime.userns import BASE, SIZE

WHERE = ("restored", "restored ws.fork", "loaded tpl.fork")


@pytest.fixture(scope="module")
def boxes(tmp_path_factory):
    """The escape attempts' workspace (tests/test_escape.py) dumped and closed, then restored;
    a fork of the restored workspace; a fork of a template saved from it and loaded."""
    tmp = tmp_path_factory.mktemp("criu-sandbox")
    made = []
    try:
        with bunshin.Workspace.create(isolation="sandbox", pids_limit=test_escape.PIDS_LIMIT,
                                      memory_limit="256M", disk_limit=test_escape.DISK_LIMIT) as ws:
            ws.write_file("/escape.py", (Path(__file__).parent / "victims" / "escape.py").read_text())
            ws.spawn(["sleep", "100000"])
            criu.dump_workspace(ws, tmp / "img")
        made.append(criu.restore_workspace(tmp / "img"))
        made += made[0].fork(1)
        with made[0].snapshot() as tpl:
            tpl.save(tmp / "tpl")
        loaded = bunshin.Template.load(tmp / "tpl")
        try:
            made += loaded.fork(1)
        finally:
            loaded.close()
        yield dict(zip(WHERE, made))
    finally:
        for w in reversed(made):
            w.close()


@pytest.fixture(params=WHERE)
def box(request, boxes):
    return request.param, boxes[request.param]


def test_the_attempts_run_here():
    """test_escape.py's attempts are found (a renamed ``box`` would leave none here)."""
    assert len(ATTEMPT_TESTS) >= 20, sorted(ATTEMPT_TESTS)


def test_the_restored_boxes_are_sandboxes(boxes):
    for w in boxes.values():
        assert re.fullmatch(rb"\s*0\s+%d\s+%d\s*" % (BASE, SIZE), w.run("cat /proc/self/uid_map").stdout)
        assert b"Seccomp:\t2" in w.run("cat /proc/self/status").stdout

