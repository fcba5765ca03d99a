"""Live workspace states (frozen templates) held in memory within a byte budget.

Each state is a :class:`bunshin.Template` keyed by its trie node. Its memory cost is the
template's own unique memory: the pages its frozen processes map and no other cached state
maps (``bunshin.memory.pids_usage`` over all states), re-measured whenever the table is over
budget — what closing it would free among the cached states. (Pages it shares only with a
live workspace count as its own.) A new state is admitted at its resident size, an upper bound,
until the next measurement. Eviction drops the states of least value until the total fits:

    value = re-execution time × reuse probability ÷ memory cost

with the re-execution time of the node's own call, and the reuse probability the smoothed share
of the parent's visits that went to this node (``MetaStore.reuse_probability``). States in use
(being forked from) are never evicted. Evicted templates are closed — after being written to
disk through CRIU when the cache has a ``spill_dir`` (restored on a hit: ``PrefixCache``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..memory import pids_usage
from ..memory.pagemap import PAGE_SIZE
from ..runtime.result import Result

if TYPE_CHECKING:
    from ..runtime.template import Template

__all__ = ["State", "StateTable", "template_cost"]


def template_cost(tpl: Template) -> int:
    """Resident bytes of ``tpl``'s frozen processes (shared pages counted once), ≥ one page."""
    u = pids_usage({"tpl": tpl.host_pids()}, pss=False)
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

    def remeasure(self) -> None:
        """Each state's cost := its unique memory among all cached states (one pagemap pass)."""
        if not self.states:
            return
        u = pids_usage({k.hex(): st.template.host_pids() for k, st in self.states.items()}, pss=False)
        for k, st in self.states.items():
            st.cost = max(u.per_workspace[k.hex()].private_bytes, PAGE_SIZE)
        self.used = sum(st.cost for st in self.states.values())

    def over_budget(self, reuse: Callable[[bytes, bytes], float]) -> list[State]:
        """Remove and return the least valuable unpinned states until the total fits."""
        if self.used <= self.budget:
            return []
        self.remeasure()
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
