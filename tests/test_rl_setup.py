"""A task's set-up state as a template: a snapshot refused for a state that passes by itself (the
ready check's connection still closing in the task's server) is retried until it can be taken."""

from __future__ import annotations

import pytest

from bunshin.cache.toolcall import ToolCall
from bunshin.errors import ForkError
from bunshin.rl import Task
from bunshin.rl.workspaces import build, set_up_template

# a server that keeps each connection half-closed (CLOSE_WAIT) for a while after its client left
SERVER = """import socket, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 7001))
s.listen()
while True:
    c, _ = s.accept()
    while c.recv(100):
        pass
    time.sleep(1.0)
    c.close()
"""
PROBE = "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 7001)).close()\""
TASK = Task("closing", "p", setup=(ToolCall("write_file", {"path": "/srv/s.py", "content": SERVER}),
                                   "python3 /srv/s.py > /dev/null 2>&1 &"), ready=PROBE)


def test_a_closing_connection_is_a_transient_refusal_and_set_up_waits_it_out(no_leaks):
    base, _ = build(TASK, "base")
    try:
        with pytest.raises(ForkError, match="CLOSE_WAIT") as e:
            base.snapshot()
        assert e.value.transient
    finally:
        base.close()
    tpl = set_up_template(TASK)
    try:
        (kid,) = tpl.fork(1)
        with kid:
            assert kid.run(PROBE, timeout=10).ok  # the server came along, listening
    finally:
        tpl.close()
