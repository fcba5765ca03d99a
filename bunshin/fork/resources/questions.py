"""What /proc does not show of a template process, asked of it by injected calls: the questions
of every module about one process run as one batch, in one stop of that process (asked one
module at a time, a shell's first fork took four stops). A module of PROC_REGISTRY with an
``ask(ctx, proc, q)`` puts its question on ``q`` there; the answer is in before any
``fixup_proc`` runs (resources.ask_template)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...compel import Tracee

Calls = list[tuple[int, tuple[int, ...], int]]  # (nr, args, flags) as Tracee.calls takes them


class Question:
    """Calls that write ``size`` bytes of answer into the process's memory: ``build(addr,
    first)`` makes them given that memory's address and the batch index of its first call
    (for Tracee.batch_ref arguments); ``answer(results, data)`` takes their results (those
    that ran: a call failing without a flag allowing it ends the batch) and those bytes."""

    __slots__ = ("size", "build", "answer")

    def __init__(self, size: int, build: Callable[[int, int], Calls],
                 answer: Callable[[list[int], bytes], None]) -> None:
        self.size, self.build, self.answer = size, build, answer


class Questions:
    """The questions of one template process, run together by :meth:`run`. ``src`` gives its
    Tracee only then: looking a held template's up thaws it, which a fork with nothing to ask
    must not do."""

    def __init__(self, src: Callable[[], Tracee]) -> None:
        self._src = src
        self._asked: list[Question] = []

    def ask(self, size: int, build: Callable[[int, int], Calls],
            answer: Callable[[list[int], bytes], None]) -> None:
        self._asked.append(Question(size, build, answer))

    def run(self) -> None:
        if not self._asked:
            return
        src = self._src()
        with src.scratch() as base:
            calls: Calls = []
            placed: list[tuple[Question, int, int, int]] = []  # its first call, how many, its memory
            at = base
            for qn in self._asked:
                mine = qn.build(at, len(calls))
                if len(calls) + len(mine) > src.max_calls():
                    placed.append((qn, -1, 0, at))  # asked alone
                else:
                    placed.append((qn, len(calls), len(mine), at))
                    calls += mine
                at += (qn.size + 7) & ~7
            got = src.calls(calls)
            memory = src.read(base, at - base) if at > base else b""
            for qn, first, n, addr in placed:
                if 0 <= first < len(got):  # its calls ran, up to one that failed
                    qn.answer(got[first:first + n], memory[addr - base:addr - base + qn.size])
                else:  # an earlier question's call ended the batch, or no room: this one alone
                    alone = src.calls(qn.build(addr, 0))
                    qn.answer(alone, src.read(addr, qn.size) if qn.size else b"")
