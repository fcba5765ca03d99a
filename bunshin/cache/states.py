"""Live workspace states (frozen templates) held in memory within a byte budget.

Each state is a :class:`bunshin.Template` keyed by its trie node. Its memory cost is the
resident memory of the template's frozen processes, each physical page counted once
(``bunshin.memory.pids_usage``), measured when the state is admitted. This is an upper bound
of what closing it frees: pages it still shares copy-on-write with its forks are counted too
(documented approximation; re-measuring unique pages across the family is left to a later
slice). Eviction drops the states of least value until the total fits the budget:

    value = re-execution time × reuse probability ÷ memory cost

with the re-execution time of the node's own call, and the reuse probability the smoothed share
of the parent's visits that went to this node (``MetaStore.reuse_probability``). States in use
(being forked from) are never evicted. Evicted templates are closed; spilling them to disk
through CRIU is ``PrefixCache.spill`` (issue 8).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..memory import pids_usage
from ..memory.pagemap import PAGE_SIZE
from ..runtime.result import Result

if TYPE_CHECKING:
    from ..fork.template import Template

__all__ = ["State", "StateTable", "template_cost"]


def template_cost(tpl: Template) -> int:
    """Resident bytes of ``tpl``'s frozen processes (shared pages counted once), ≥ one page."""
    pids = [pl.hostpid for pl in tpl._core.plans]
    u = pids_usage({"tpl": pids}, pss=False)
    return max(u.per_workspace["tpl"].rss_bytes, PAGE_SIZE)


@dataclass
class State:
    """One cached state: the template, the session shell inside it, and what it is worth."""

    key: bytes
    parent: bytes
    template: Template
    shell: tuple[int, str] | None  # (pid, nonce) of the session's shell in the template
    result: Result
    exec_time: float
    cost: int
    pins: int = field(default=0)


class StateTable:
    """The in-memory table of states; callers hold the cache's lock around every method."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.states: dict[bytes, State] = {}
        self.used = 0

    def get(self, key: bytes) -> State | None:
        return self.states.get(key)

    def add(self, st: State) -> None:
        old = self.states.pop(st.key, None)
        if old is not None:
            self.used -= old.cost
        self.states[st.key] = st
        self.used += st.cost

    def remove(self, key: bytes) -> State | None:
        st = self.states.pop(key, None)
        if st is not None:
            self.used -= st.cost
        return st

    def over_budget(self, reuse: Callable[[bytes, bytes], float]) -> list[State]:
        """Remove and return the least valuable unpinned states until the total fits."""
        if self.used <= self.budget:
            return []
        ranked = sorted((st for st in self.states.values() if st.pins == 0),
                        key=lambda st: st.exec_time * reuse(st.parent, st.key) / st.cost)
        out = []
        for st in ranked:
            if self.used <= self.budget:
                break
            self.remove(st.key)
            out.append(st)
        return out
