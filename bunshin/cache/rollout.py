"""``CachedRollout``: one rollout's workspace driven through a :class:`PrefixCache`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..runtime.result import Result
from .errors import UnknownTool
from .states import State, template_cost
from .store import encode_result
from .toolcall import ToolCall, as_tool_call, child_key, root_key
from .tools import ToolContext, run_tool

if TYPE_CHECKING:
    from ..runtime.shell import Shell
    from ..runtime.workspace import Workspace
    from .prefix import PrefixCache

__all__ = ["CachedRollout"]


def _same_output(a: Result, b: Result) -> bool:
    return (a.stdout, a.stderr, a.exit_code) == (b.stdout, b.stderr, b.exit_code)


class CachedRollout:
    """Calls tools on ``ws`` through the cache; use one session per workspace, one thread.

    ``call(c)`` on a hit makes ``ws`` a fork of the cached state (``ws.restore``: the same
    object keeps working, the session's shell continues in the cached state) and returns the
    recorded result without executing; on a miss it executes, records and, by the cache's
    policy, keeps the state. ``key`` is the current node (None once the session left the trie
    through a non-cacheable call or a tool error).
    """

    def __init__(self, cache: PrefixCache, ws: Workspace, task_id: str) -> None:
        self.cache = cache
        self.ws = ws
        self.task_id = task_id
        self.key: bytes | None = root_key(task_id)
        self._shell: Shell | None = None
        self.last_source = "exec"
        """How the last call was answered: "exec", "cache" (a hit) or "speculation" (an
        adopted speculative fork, set by the executor)."""

    @property
    def shell(self) -> Shell:
        """The session's persistent shell (where ``bash`` calls run; opened on first use)."""
        if self._shell is None or not self._shell.alive:
            self._shell = self.ws.shell()
        return self._shell

    def _execute(self, call: ToolCall) -> Result:
        return run_tool(self.cache.tools, ToolContext(self.ws, lambda: self.shell), call)

    def call(self, call: ToolCall | str) -> Result:
        """Run ``call`` (a :class:`ToolCall`, or a str: a bash command) through the cache."""
        cache = self.cache
        cache.check_open()
        self.last_source = "exec"
        tc = as_tool_call(call)
        if tc.name not in cache.tools:
            raise UnknownTool(f"no tool named {tc.name!r}; registered: {sorted(cache.tools)}")
        parent = self.key
        if parent is None or not cache.is_cacheable(tc):
            cache.count(uncacheable=1)
            self.key = None
            return self._execute(tc)
        key = child_key(parent, tc)
        cache.store.visit(parent, key, tc.canonical)
        st, owner = cache.claim(key)
        if st is not None:
            return self._hit(tc, key, st)
        return self._miss(tc, parent, key, owner=owner)

    def _hit(self, tc: ToolCall, key: bytes, st: State) -> Result:
        cache = self.cache
        try:
            if cache.sample_verify():
                fresh = self._miss(tc, st.parent, key, owner=False, snapshot=False)
                cache.count(verified=1, mismatches=0 if _same_output(fresh, st.result) else 1)
                return fresh
            self.ws.restore(st.template)
        finally:
            cache.unpin(st)
        self._adopt_shell(st.shell)
        self.last_source = "cache"
        cache.count(hits=1, saved_seconds=st.exec_time)
        self.key = key
        return st.result

    def _adopt_shell(self, ident: tuple[int, str] | None) -> None:
        """After a restore: continue on the template's session shell (or none)."""
        self._shell = None
        if ident is None:
            return
        pid, _nonce = ident
        for sh in self.ws.shells:
            if sh.pid == pid and sh.alive:
                self._shell = sh
                return

    def _miss(self, tc: ToolCall, parent: bytes, key: bytes, *, owner: bool,
              snapshot: bool = True) -> Result:
        cache = self.cache
        try:
            t0 = time.monotonic()
            try:
                r = self._execute(tc)
            except BaseException:
                self.key = None  # the state is unknown now: leave the trie
                raise
            dt = time.monotonic() - t0
            rec = encode_result(r, cache.record_limit)

            def fn(d: dict) -> None:
                d["result"], d["exec_time"] = rec, dt
            cache.store.update(key, fn)
            if snapshot:
                cache.count(misses=1)
            if snapshot and not rec["record_truncated"] and cache.wants_snapshot(tc, r, dt):
                tpl = cache.snapshot_of(self.ws)
                if tpl is not None:
                    sh = self._shell if self._shell is not None and self._shell.alive else None
                    ident = (sh.pid, sh.id) if sh is not None else None
                    try:
                        cost = template_cost(tpl)
                    except BaseException:
                        tpl.close()
                        raise
                    cache.admit(State(key=key, parent=parent, template=tpl, shell=ident, result=r,
                                       exec_time=dt, cost=cost))
        finally:
            if owner:
                cache.release(key)
        self.key = key
        return r
