"""Node metadata in LMDB (py-lmdb), shared by every trainer process on the machine.

One file (``subdir=False``; LMDB adds ``<path>-lock``). Named databases:

- ``bunshin``: the format marker ``format = bunshin-prefix-cache``, ``version = 1``. A file
  without it is refused (:class:`CacheFormatError`) and left untouched: it is first checked
  through a read-only, lock-free handle, which writes nothing (not even the lock file).
- ``nodes``: 16-byte node key → JSON record ``{parent, call, visits, children: {hex key:
  count}, result, exec_time, mem_cost, template}``. ``result`` holds stdout/stderr (base64,
  each cut to the store's ``record_limit`` with ``record_truncated`` set), ``exit_code``,
  ``timed_out``, ``truncated``; ``template`` says which process holds a live template of the
  state (``"<pid>:<template id>"``) or is null.

py-lmdb environments must not cross ``fork()``: the environment is opened lazily by the
process that uses it, and reopened (the inherited handle abandoned, never used) when the
process id changed.
"""

from __future__ import annotations

import base64
import json
import os
import threading
from typing import Any

import lmdb

from ..runtime.result import Result
from .errors import CacheFormatError

__all__ = ["FORMAT", "VERSION", "MetaStore"]

FORMAT = b"bunshin-prefix-cache"
VERSION = b"1"
_MAX_DBS = 4
_abandoned: list[lmdb.Environment] = []  # inherited across fork(): never touched again


def _check_existing(path: str) -> None:
    """Refuse, without writing anything, a file that is not a Bunshin prefix cache."""
    if os.path.isdir(path):
        raise CacheFormatError(f"prefix cache {path}: is a directory, not a Bunshin cache file")
    if os.path.getsize(path) == 0:
        raise CacheFormatError(f"prefix cache {path}: empty file, not a Bunshin cache file; "
                               "remove it or pass a path that does not exist yet")
    try:
        env = lmdb.open(path, subdir=False, readonly=True, lock=False, max_dbs=_MAX_DBS)
    except lmdb.Error as e:
        raise CacheFormatError(f"prefix cache {path}: not an LMDB file ({e}); left untouched") from None
    try:
        _check_marker(env, path)
    finally:
        env.close()


def _check_marker(env: lmdb.Environment, path: str) -> None:
    try:
        db = env.open_db(b"bunshin", create=False)
        with env.begin(db=db) as txn:
            fmt, ver = txn.get(b"format"), txn.get(b"version")
    except lmdb.Error as e:
        raise CacheFormatError(f"prefix cache {path}: an LMDB file without the Bunshin format marker "
                               f"(another program's?) ({e}); left untouched") from None
    if fmt != FORMAT:
        raise CacheFormatError(f"prefix cache {path}: format marker is {fmt!r}, expected {FORMAT!r}; "
                               "left untouched")
    if ver != VERSION:
        raise CacheFormatError(f"prefix cache {path}: format version {ver!r}, this Bunshin reads "
                               f"{VERSION!r}; left untouched")


def encode_result(r: Result, limit: int) -> dict[str, Any]:
    """A JSON-able record of ``r`` with each stream cut to ``limit`` bytes."""
    return {"stdout": base64.b64encode(r.stdout[:limit]).decode(),
            "stderr": base64.b64encode(r.stderr[:limit]).decode(),
            "exit_code": r.exit_code, "duration": r.duration, "timed_out": r.timed_out,
            "truncated": r.truncated, "signal": r.signal, "oom_killed": r.oom_killed,
            "record_truncated": len(r.stdout) > limit or len(r.stderr) > limit}


class MetaStore:
    """Node metadata of one prefix cache file. Thread-safe; fork-safe (reopens after fork)."""

    def __init__(self, path: str | os.PathLike, *, map_size: int = 1 << 30) -> None:
        self.path = os.fspath(path)
        self.map_size = map_size
        self._lock = threading.Lock()
        self._env: lmdb.Environment | None = None
        self._nodes: Any = None  # lmdb names its database type only privately
        self._pid = -1
        self._closed = False
        self._open()  # validate now, so a bad path fails at construction

    def _open(self) -> tuple[lmdb.Environment, Any]:
        with self._lock:
            if self._closed:
                from .errors import CacheError
                raise CacheError(f"prefix cache {self.path} is closed")
            if self._env is not None and self._pid == os.getpid():
                return self._env, self._nodes
            if self._env is not None:
                _abandoned.append(self._env)  # opened by our parent before fork(): unusable here
            self._env = None
            if os.path.lexists(self.path):
                _check_existing(self.path)
                new = False
            else:
                new = True
            try:
                env = lmdb.open(self.path, subdir=False, map_size=self.map_size, max_dbs=_MAX_DBS)
            except lmdb.Error as e:
                raise CacheFormatError(f"prefix cache {self.path}: cannot open ({e})") from None
            try:
                if new:
                    meta = env.open_db(b"bunshin")
                    with env.begin(write=True, db=meta) as txn:
                        txn.put(b"format", FORMAT, overwrite=False)
                        txn.put(b"version", VERSION, overwrite=False)
                _check_marker(env, self.path)
                nodes = env.open_db(b"nodes")
            except BaseException:
                env.close()
                raise
            self._env, self._nodes, self._pid = env, nodes, os.getpid()
            return env, nodes

    def get(self, key: bytes) -> dict[str, Any] | None:
        """The record of node ``key``, or None."""
        env, nodes = self._open()
        with env.begin(db=nodes) as txn:
            raw = txn.get(key)
        return None if raw is None else json.loads(raw)

    def update(self, key: bytes, fn) -> dict[str, Any]:
        """Read-modify-write node ``key`` in one write transaction (atomic across processes)."""
        env, nodes = self._open()
        with env.begin(write=True, db=nodes) as txn:
            raw = txn.get(key)
            rec = json.loads(raw) if raw is not None else {
                "parent": None, "call": None, "visits": 0, "children": {}, "result": None,
                "exec_time": None, "mem_cost": None, "template": None}
            fn(rec)
            txn.put(key, json.dumps(rec, separators=(",", ":")).encode())
        return rec

    def visit(self, parent: bytes, key: bytes, call: bytes) -> None:
        """Count one pass from ``parent`` to its child ``key`` (both records, one transaction)."""
        env, nodes = self._open()
        with env.begin(write=True, db=nodes) as txn:
            for k, fn in ((parent, lambda r: r["children"].__setitem__(key.hex(), r["children"].get(key.hex(), 0) + 1)),
                          (key, None)):
                raw = txn.get(k)
                rec = json.loads(raw) if raw is not None else {
                    "parent": None, "call": None, "visits": 0, "children": {}, "result": None,
                    "exec_time": None, "mem_cost": None, "template": None}
                if fn is not None:
                    fn(rec)
                else:
                    rec["visits"] += 1
                    rec["parent"] = parent.hex()
                    rec["call"] = call.decode("utf-8")
                txn.put(k, json.dumps(rec, separators=(",", ":")).encode())

    def reuse_probability(self, parent: bytes | None, key: bytes) -> float:
        """How often passes through ``parent`` went on to ``key`` (Laplace-smoothed)."""
        if parent is None:
            return 1.0
        rec = self.get(parent)
        if rec is None:
            return 0.5
        ch = rec["children"]
        return (ch.get(key.hex(), 0) + 1) / (sum(ch.values()) + 2)

    def close(self) -> None:
        """Close the environment (in the process that opened it)."""
        with self._lock:
            self._closed = True
            if self._env is not None and self._pid == os.getpid():
                self._env.close()
            self._env = None
