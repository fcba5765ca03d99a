"""An epoll's entries and an inotify's watches are read from fdinfo lines: a line in a form
the fork does not read (another kernel's) is refused at plan time, naming the process and fd,
rather than leaving the child without that entry or watch. The parsers are made to miss a
line here; the kernel and the workspace are real."""

from __future__ import annotations

import re

import pytest

from bunshin.errors import ForkError
from bunshin.fork.resources import epoll, inotify

from conftest import fork_by, start_script

WATCHER = """
import select
r, w = os.pipe()
ep = select.epoll()
ep.register(r, select.EPOLLIN)
libc = __import__('ctypes').CDLL(None)
ino = libc.inotify_init1(0)
assert libc.inotify_add_watch(ino, b'/tmp', 0x100) > 0  # IN_CREATE
out('/tmp/ready', 'ok')
time.sleep(1000)
"""

NEVER = re.compile(r"(?!)")


@pytest.mark.parametrize("path", ["ws_fork", "tpl_fork"])
@pytest.mark.parametrize("module,attr,said", [(epoll, "_LINE", "epoll lists 1 entries"),
                                              (inotify, "_WATCH", "inotify lists 1 watches")],
                         ids=["epoll", "inotify"])
def test_unread_line_refused(family, monkeypatch, module, attr, said, path):
    ws = start_script(family, WATCHER, "/tmp/ready")
    monkeypatch.setattr(module, attr, NEVER)
    with pytest.raises(ForkError, match=f"{said} in fdinfo, 0 of them") as e:
        fork_by(ws, path)
    assert "python3" in str(e.value) and " fd " in str(e.value)
    monkeypatch.undo()
    (kid,) = [fork_by(ws, path)]  # read as it is, the same workspace forks
    family.append(kid)
