"""Net, ipc and uts namespaces of forks: each child gets its own, whether they come from the
pool made ahead of time or are made by the fork itself."""

from __future__ import annotations

import os
import time

import pytest

import bunshin
from bunshin.fork import nspool


def _ns(w: bunshin.Workspace, kind: str) -> str:
    return os.readlink(f"/proc/{w.init_pid}/ns/{kind}")


def _check_own_namespaces(family: list[bunshin.Workspace]) -> None:
    for kind in ("net", "ipc", "uts"):
        seen = [_ns(w, kind) for w in family]
        assert len(set(seen)) == len(seen), f"{kind} namespaces shared: {seen}"
        assert os.readlink(f"/proc/self/ns/{kind}") not in seen
    for w in family:
        # lo is up, alone, and /sys shows the child's own net namespace
        r = w.run("cat /sys/class/net/lo/flags; ls /sys/class/net; python3 -c "
                  "\"import socket; s=socket.socket(); s.bind(('127.0.0.1', 8765)); s.listen(); print('bound')\"")
        assert r.exit_code == 0, r
        assert r.stdout.split() == [b"0x9", b"lo", b"bound"]


def _fill(p: nspool.NamespacePool) -> None:
    """Start the pool's thread and wait until it has made its sets."""
    got = p.take()
    if got is not None:
        got.close()
    p.refill()
    deadline = time.monotonic() + 10
    while len(p._ready) < p.size and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(p._ready) == p.size


@pytest.fixture
def pooled(monkeypatch):
    p = nspool.NamespacePool(2)
    _fill(p)
    monkeypatch.setattr(nspool, "pool", lambda: p)
    yield p
    p.drain()


@pytest.mark.parametrize("use_pool", [True, False], ids=["pool", "no-pool"])
def test_each_fork_has_its_own_net_ipc_uts(use_pool, pooled, monkeypatch):
    if not use_pool:
        monkeypatch.setattr(nspool, "pool", lambda: None)
    # the pool's namespaces are the trainer's user namespace's: a sandbox's forks make their own
    ws = bunshin.Workspace.create(hostname="src", isolation="trusted")
    family = [ws]
    try:
        ws.run("python3 -c \"import socket,time; s=socket.socket(); s.bind(('127.0.0.1', 8765))\"")
        # 3 forks: some sets from the pool, some made by the fork itself (the first fill's
        # take missed too)
        family += ws.fork(3)
        _check_own_namespaces(family)
        for w in family:
            assert w.run("hostname").stdout.strip() == b"src"
        if use_pool:
            assert pooled.taken >= 2 and pooled.missed >= 2
            _fill(pooled)
            taken = pooled.taken
            family += ws.fork(1)
            _check_own_namespaces(family)
            assert pooled.taken == taken + 1  # the source runs on in its own
    finally:
        for w in family:
            w.close()


def test_pool_sets_are_fresh_and_distinct():
    p = nspool.NamespacePool(3)
    try:
        _fill(p)
        got = [p.take() for _ in range(3)]
        assert all(got) and p.taken == 3 and p.take() is None
        for kind in ("net", "ipc", "uts"):
            inodes = {os.fstat(getattr(s, kind)).st_ino for s in got}
            assert len(inodes) == 3
            assert os.stat(f"/proc/self/ns/{kind}").st_ino not in inodes
        for s in got:
            s.close()
    finally:
        p.drain()


def test_a_sandboxs_forks_take_sets_of_its_own_user_namespace():
    """fork/nsmaker.py: the sets a sandbox's children join are made in its user namespace."""
    ws = bunshin.Workspace.create(hostname="src", isolation="sandbox")
    family = [ws]
    try:
        family += ws.fork(1)  # its namespace's pool is made, and filled after this first take
        pool = ws.body.userns.pool
        assert pool is not None
        deadline = time.monotonic() + 10
        while len(pool._ready) < pool.size and time.monotonic() < deadline:
            time.sleep(0.01)
        taken = pool.taken
        family += ws.fork(2)
        assert pool.taken == taken + 2
        _check_own_namespaces(family)
        user = os.stat(f"/proc/{ws.init_pid}/ns/user").st_ino
        for w in family:
            assert os.stat(f"/proc/{w.init_pid}/ns/user").st_ino == user
    finally:
        for w in reversed(family):
            w.close()
    assert ws.body.userns is None  # the last one closed took its namespace's pool along
    assert pool._ready == []
