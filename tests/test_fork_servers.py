"""Real servers across a fork: Redis with data answers in both workspaces, independently."""

from __future__ import annotations

import shutil
import time

import pytest

import bunshin

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is installed by scripts/install-deps.sh")


def _cli(w, *args: str) -> bytes:
    return w.exec(["redis-cli", "-p", "6390", *args]).stdout.strip()


def test_redis_with_data_forks(no_leaks):
    with bunshin.Workspace.create() as ws:
        ws.spawn(["redis-server", "--port", "6390", "--save", "", "--appendonly", "no",
                  "--daemonize", "no"], log_path="/tmp/redis.log")
        deadline = time.monotonic() + 20
        while _cli(ws, "ping") != b"PONG":
            assert time.monotonic() < deadline, ws.read_file("/tmp/redis.log")
            time.sleep(0.05)
        script = "\n".join(f"SET key:{i} value-{i}" for i in range(2000))
        ws.exec(["redis-cli", "-p", "6390"], stdin=script.encode())
        assert _cli(ws, "dbsize") == b"2000"
        (kid,) = ws.fork(1)
        try:
            assert _cli(kid, "dbsize") == b"2000"
            assert _cli(kid, "get", "key:1234") == b"value-1234"
            _cli(kid, "set", "only", "child")
            _cli(ws, "set", "only", "source")
            _cli(kid, "del", "key:1")
            assert _cli(kid, "get", "only") == b"child" and _cli(ws, "get", "only") == b"source"
            assert _cli(ws, "get", "key:1") == b"value-1" and _cli(kid, "get", "key:1") == b""
            assert _cli(kid, "dbsize") == b"2000" and _cli(ws, "dbsize") == b"2001"
        finally:
            kid.close()
