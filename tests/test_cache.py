"""The tool-prefix cache on real workspaces: hits skip execution yet reproduce the state."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import lmdb

from bunshin.cache.states import template_cost
import pytest

import bunshin
from bunshin.cache import (
    CacheError,
    CacheFormatError,
    InvalidToolCall,
    PrefixCache,
    ToolCall,
    UnknownTool,
    child_key,
    root_key,
)

COUNT = "echo x >> /tmp/count; "


@pytest.fixture
def base():
    """A base workspace with a side-effect counter outside the workspaces (host file)."""
    ws = bunshin.Workspace.create()
    yield ws
    ws.close()


@pytest.fixture
def cache(tmp_path):
    c = PrefixCache(tmp_path / "c.lmdb")
    yield c
    c.close()


def test_toolcall_canonical_and_keys():
    a = ToolCall("bash", {"command": "ls", "z": [1, {"b": True, "a": None}]})
    assert a.canonical == b'["bash",{"command":"ls","z":[1,{"a":null,"b":true}]}]'
    assert ToolCall("write_file", {"path": "/é", "content": ""}).canonical == \
        '["write_file",{"content":"","path":"/é"}]'.encode()
    from bunshin.cache import as_tool_call
    assert as_tool_call("ls") == ToolCall("bash", {"command": "ls"})
    r1, r2 = root_key("t1"), root_key("t2")
    assert r1 != r2 and len(r1) == 16
    assert child_key(r1, a) != child_key(r2, a)
    assert child_key(r1, a) == child_key(r1, ToolCall("bash", {"z": [1, {"a": None, "b": True}], "command": "ls"}))
    with pytest.raises(InvalidToolCall, match="float"):
        ToolCall("bash", {"timeout": 1.5})
    with pytest.raises(InvalidToolCall, match="bytes"):
        ToolCall("bash", {"command": b"ls"})
    with pytest.raises(InvalidToolCall, match="keys must be str"):
        ToolCall("bash", {"a": {1: 2}})
    with pytest.raises(InvalidToolCall, match="non-empty"):
        ToolCall("", {})
    with pytest.raises(InvalidToolCall, match="task_id"):
        root_key("")


def test_hit_skips_execution_and_reproduces_state(base, cache, tmp_path):
    a, b = base.fork(2)
    try:
        steps = ["cd /tmp && export V=$((6*7)) && mkdir -p d",
                 ToolCall("write_file", {"path": "/tmp/d/f.txt", "content": "hello"}),
                 COUNT + "echo $V $PWD; cat d/f.txt",
                 ToolCall("python", {"code": "print(open('/tmp/d/f.txt').read().upper())"})]
        ca, cb = cache.rollout(a, "t"), cache.rollout(b, "t")
        ra = [ca.call(s) for s in steps]
        assert ra[2].stdout.replace(b"\r", b"") == b"42 /tmp\nhello"
        assert ra[3].stdout == b"HELLO\n"
        assert a.read_file("/tmp/count") == b"x\n"
        assert cache.stats.misses == 4 and cache.stats.hits == 0
        rb = [cb.call(s) for s in steps]
        assert cache.stats.hits == 4
        assert [(r.stdout, r.exit_code) for r in rb] == [(r.stdout, r.exit_code) for r in ra]
        # b never executed the counter, yet has a's state: files, cwd and shell variables
        assert b.read_file("/tmp/count") == b"x\n"
        assert b.read_file("/tmp/d/f.txt") == b"hello"
        assert cb.shell.run("echo $V $PWD").stdout.replace(b"\r", b"") == b"42 /tmp\n"
        # the session continues normally past the cached prefix
        assert cb.call("echo more $V").stdout.strip() == b"more 42"
        assert cache.stats.misses == 5
        # the user's ws object still works
        assert b.run("cat /tmp/d/f.txt").stdout == b"hello"
    finally:
        a.close()
        b.close()


def test_cached_results_equal_fresh_execution(base, tmp_path):
    steps = ["printf 'a\\nb\\n' > /tmp/x; wc -l /tmp/x", "sort -r /tmp/x", "ls /nope; echo $?",
             ToolCall("read_file", {"path": "/tmp/x"})]
    fresh_ws = base.fork(1)[0]
    a, b = base.fork(2)
    try:
        fresh = [ToolCall("bash", {"command": s}) if isinstance(s, str) else s for s in steps]
        sh = fresh_ws.shell()
        want = [sh.run(s.args["command"]).stdout if s.name == "bash" else fresh_ws.read_file(s.args["path"])
                for s in fresh]
        with PrefixCache(tmp_path / "c.lmdb") as cache:
            ca = cache.rollout(a, "t")
            assert [ca.call(s).stdout for s in steps] == want
            cb = cache.rollout(b, "t")
            got = [cb.call(s).stdout for s in steps]
            assert cache.stats.hits == len(steps)
        assert got == want
    finally:
        for w in (fresh_ws, a, b):
            w.close()


def test_task_ids_do_not_share(base, cache):
    a, b = base.fork(2)
    try:
        cache.rollout(a, "task-A").call(COUNT + "echo a")
        cache.rollout(b, "task-B").call(COUNT + "echo a")
        assert cache.stats.hits == 0 and cache.stats.misses == 2
        assert b.read_file("/tmp/count") == b"x\n"  # executed in b itself
    finally:
        a.close()
        b.close()


def test_concurrent_sessions_execute_once(base, tmp_path):
    n = 4
    host_count = tmp_path / "executions"
    kids = base.fork(n)
    try:
        with PrefixCache(tmp_path / "c.lmdb") as cache:
            def count(ctx, **args):
                with open(host_count, "a") as f:  # on the host: counts every execution
                    f.write("x\n")
                return ctx.shell().run(args["command"])
            cache.register_tool("counted", count)
            call = ToolCall("counted", {"command": "sleep 0.5; echo done > /tmp/state; echo ok"})
            barrier = threading.Barrier(n)
            out, errs = [None] * n, []

            def go(i):
                try:
                    cw = cache.rollout(kids[i], "t")
                    barrier.wait()
                    out[i] = cw.call(call)
                except BaseException as e:  # noqa: BLE001 - reported below
                    errs.append(e)
            ts = [threading.Thread(target=go, args=(i,)) for i in range(n)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            assert not errs, errs
            assert host_count.read_text() == "x\n"
            st = cache.stats
            assert (st.misses, st.hits, st.waits) == (1, n - 1, n - 1)
            assert all(r.stdout == out[0].stdout for r in out) and b"ok" in out[0].stdout
            for k in kids:
                assert k.read_file("/tmp/state") == b"done\n"
    finally:
        for k in kids:
            k.close()


def test_uncacheable_and_unknown_tools(base, tmp_path):
    a, b = base.fork(2)
    try:
        with PrefixCache(tmp_path / "c.lmdb", cacheable=lambda c: "date" not in c.args.get("command", "")) as cache:
            for w in (a, b):
                cw = cache.rollout(w, "t")
                cw.call(COUNT + "date")
                assert cw.key is None
                cw.call(COUNT + "true")  # after leaving the trie: executes too
            assert cache.stats.uncacheable == 4 and cache.stats.hits == 0
            assert b.read_file("/tmp/count") == b"x\nx\n"
            with pytest.raises(UnknownTool, match="nope"):
                cache.rollout(a, "t").call(ToolCall("nope", {}))
            with pytest.raises(InvalidToolCall, match="command"):
                cache.rollout(a, "t").call(ToolCall("bash", {"cmd": "ls"}))
            with pytest.raises(CacheError, match="already registered"):
                cache.register_tool("bash", lambda ctx: None)
            with pytest.raises(CacheError, match="spill_dir"):
                cache.spill(root_key("t"))
    finally:
        a.close()
        b.close()


def test_verify_counts_mismatches(base, tmp_path):
    a, b = base.fork(2)
    try:
        with PrefixCache(tmp_path / "c.lmdb", verify=1.0) as cache:
            cache.rollout(a, "t").call("cat /proc/sys/kernel/random/uuid")   # not deterministic
            cache.rollout(b, "t").call("cat /proc/sys/kernel/random/uuid")
            st = cache.stats
            assert (st.verified, st.mismatches, st.hits) == (1, 1, 0)
    finally:
        a.close()
        b.close()


def test_eviction_under_tiny_budget(base, tmp_path):
    a, b = base.fork(2)
    try:
        with PrefixCache(tmp_path / "c.lmdb", memory_budget=1) as cache:
            ca = cache.rollout(a, "t")
            assert ca.call(COUNT + "echo one").stdout.strip() == b"one"
            st = cache.stats
            assert st.snapshots == 1 and st.evictions == 1 and cache.live_states() == []
            assert cache.store.get(ca.key)["template"] is None
            cb = cache.rollout(b, "t")
            assert cb.call(COUNT + "echo one").stdout.strip() == b"one"  # re-executed correctly
            assert b.read_file("/tmp/count") == b"x\n" and cache.stats.hits == 0
    finally:
        a.close()
        b.close()


def test_eviction_keeps_the_more_valuable_state(base, tmp_path):
    a = base.fork(1)[0]
    try:
        with PrefixCache(tmp_path / "c.lmdb") as cache:
            cw = cache.rollout(a, "t")
            cw.call("sleep 0.4")
            slow = cw.key
            cw.call("true")
            table = cache._states
            table.remeasure()  # costs = each state's unique memory among the cached states
            costs = {k: st.cost for k, st in table.states.items()}
            assert len(costs) == 2
            # the second state shares almost everything with the first: unique costs are far
            # below their resident sizes
            rss = template_cost(table.states[slow].template)
            assert sum(costs.values()) < rss
            table.budget = max(costs.values())  # room for one state only
            cw.call("echo trigger")  # admitting a third state evicts by value
            assert slow in cache.live_states()  # the cheap-to-redo states went first
            assert cache.stats.evictions >= 1
    finally:
        a.close()


def test_corrupt_lmdb_is_refused_untouched(tmp_path):
    p = tmp_path / "garbage.lmdb"
    data = os.urandom(3) * 5000
    p.write_bytes(data)
    with pytest.raises(CacheFormatError, match="not an LMDB"):
        PrefixCache(p)
    assert p.read_bytes() == data and sorted(os.listdir(tmp_path)) == ["garbage.lmdb"]


def test_foreign_lmdb_is_refused_untouched(tmp_path):
    p = tmp_path / "foreign.lmdb"
    env = lmdb.open(str(p), subdir=False, max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(b"user:1", b"alice")
    env.close()
    before = p.read_bytes()
    with pytest.raises(CacheFormatError, match="format marker"):
        PrefixCache(p)
    assert p.read_bytes() == before
    env = lmdb.open(str(p), subdir=False, max_dbs=2)
    with env.begin() as txn:
        assert txn.get(b"user:1") == b"alice"
    env.close()


def test_metadata_persists_across_reopen(base, tmp_path):
    a = base.fork(1)[0]
    try:
        with PrefixCache(tmp_path / "c.lmdb") as cache:
            cw = cache.rollout(a, "t")
            cw.call("echo persisted")
            key = cw.key
        with PrefixCache(tmp_path / "c.lmdb") as again:
            rec = again.store.get(key)
            parent = again.store.get(root_key("t"))
        assert rec["visits"] == 1 and rec["template"] is None and rec["exec_time"] > 0
        assert rec["mem_cost"] > 0 and parent["children"] == {key.hex(): 1}
        import base64
        assert base64.b64decode(rec["result"]["stdout"]).strip() == b"persisted"
    finally:
        a.close()


def test_bad_arguments():
    with pytest.raises(CacheError, match="memory_budget"):
        PrefixCache("/tmp/x-never-created.lmdb", memory_budget=-1)
    with pytest.raises(CacheError, match="verify"):
        PrefixCache("/tmp/x-never-created.lmdb", verify=2)
    assert not os.path.exists("/tmp/x-never-created.lmdb")


CRASHING_WRITER = r"""
import os, sys
from bunshin.cache.store import MetaStore
from bunshin.cache.toolcall import ToolCall, canonical, child_key, root_key
store = MetaStore(sys.argv[1])
root = root_key("crash")
env, nodes = store._open()
txn = env.begin(write=True, db=nodes)          # a write transaction left open...
for i in range(1000):
    txn.put(f"half-written-{i}".encode(), b"x" * 100)
print("writing", flush=True)
os.kill(os.getpid(), 9)                        # ...when the writer dies
"""


def test_lmdb_survives_a_crashed_writer(tmp_path):
    import subprocess
    import sys

    from bunshin.cache.store import MetaStore
    from bunshin.cache.toolcall import ToolCall, canonical, child_key, root_key

    path = tmp_path / "meta.lmdb"
    root = root_key("crash")
    call = ToolCall("bash", {"command": "ls"})
    key = child_key(root, call)
    store = MetaStore(path)
    store.visit(root, key, canonical(call.name, call.args))
    store.close()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    p = subprocess.run([sys.executable, "-c", CRASHING_WRITER, str(path)], capture_output=True,
                       text=True, env=env, timeout=60)
    assert p.returncode == -9 and "writing" in p.stdout, p.stderr
    again = MetaStore(path)  # another process opens it after the crash
    try:
        rec = again.get(key)
        assert rec is not None and rec["visits"] == 1  # committed data intact
        assert again.get(b"half-written-0") is None  # the dead writer's transaction is gone
        again.visit(root, key, canonical(call.name, call.args))  # and writing works again
        assert again.get(key)["visits"] == 2
    finally:
        again.close()
