"""What /proc does not show of a template process, asked of it by injected calls: the questions
about one process run as one batch, in one stop of that process (asked one at a time, a
shell's first fork took eight stops: four modules' and one per descriptor whose close-on-exec
flag fdinfo leaves open). A module of PROC_REGISTRY with an ``ask(ctx, proc, q)`` puts its
question on ``q``; the answers are in before the clone's fixups start (resources.ask_template)."""

from __future__ import annotations

from collections.abc import Callable

from ...compel import Tracee

_SYS_FCNTL = 72
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
            at, batch = base, Batch()
            for qn in self._asked:
                if not batch.add(qn, at, src.max_calls()):  # full: run it, start the next
                    batch.run(src, base)
                    batch = Batch()
                    batch.add(qn, at, src.max_calls())
                at += (qn.size + 7) & ~7
            batch.run(src, base)


class Batch:
    """Questions whose calls fit one Tracee.calls."""

    def __init__(self) -> None:
        self.calls: Calls = []
        self.placed: list[tuple[Question, int, int, int]] = []  # its first call, how many, its memory

    def add(self, qn: Question, addr: int, room: int) -> bool:
        mine = qn.build(addr, len(self.calls))
        if self.calls and len(self.calls) + len(mine) > room:
            return False
        self.placed.append((qn, len(self.calls), len(mine), addr))
        self.calls += mine
        return True

    def run(self, src: Tracee, base: int) -> None:
        if not self.calls:
            return
        got = src.calls(self.calls)
        end = max(addr + qn.size for qn, _first, _n, addr in self.placed)
        memory = src.read(base, end - base) if end > base else b""
        for qn, first, n, addr in self.placed:
            if first < len(got):  # its calls ran, up to one that failed
                qn.answer(got[first:first + n], memory[addr - base:addr - base + qn.size])
            else:  # an earlier question's call ended the batch: this one alone
                alone = src.calls(qn.build(addr, 0))
                qn.answer(alone, src.read(addr, qn.size) if qn.size else b"")


_F_GETFD, _FD_CLOEXEC = 1, 1


def ask_cloexec(proc, q: Questions) -> None:
    """The close-on-exec flag of each descriptor of ``proc`` whose flag its plan could not tell
    (FdInfo.cloexec), once: a clone's descriptor table is a copy of its template process's,
    which Remote.install gives each descriptor it recreates. EBADF (none there): without.
    One question per batch's worth of descriptors."""
    unknown = [f for f in proc.fds if f.cloexec is None]
    for at in range(0, len(unknown), Tracee.max_calls()):
        _ask_cloexec(unknown[at:at + Tracee.max_calls()], q)


def _ask_cloexec(fds: list, q: Questions) -> None:
    def answer(got: list[int], _data: bytes) -> None:
        for f, flags in zip(fds, got):
            f.cloexec = flags > 0 and bool(flags & _FD_CLOEXEC)

    q.ask(0, lambda addr, first: [(_SYS_FCNTL, (f.fd, _F_GETFD, 0), Tracee.BATCH_OK_ERR) for f in fds],
          answer)
