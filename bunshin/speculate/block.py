"""``with ws.speculate() as spec:`` — try tool calls on a fork, then keep or drop them.

>>> with ws.speculate() as spec:            # doctest: +SKIP
...     spec.run("make")                     # runs on spec.ws, a fork of ws
...     if spec.run("make test").exit_code:
...         spec.rollback()                  # ws stays exactly as before the block
>>> # leaving the block normally: ws now holds the fork's state (commit)

How: entering forks ``spec.ws`` from ws (``ws.fork()``: ws runs on untouched, as after
fork(2)). Commit makes ws *adopt* the fork (no extra fork: the same ``Workspace`` object and
its ``Shell`` objects continue in the fork's state; a shell opened in the fork becomes one of
ws's shells). Rollback closes the fork and costs nothing more: ws never left its own state
(what ws's own calls did during the block stays, as they were not the block's). An exception
inside the block rolls back and propagates.

Depth: a fork's pid namespace is below its source's (the kernel allows 32 levels), so a
committed block leaves ws one level deeper, a rolled-back one at its depth. After about 30
commits the fork on entry first moves ws back to the top level through CRIU
(runtime/workspace.py, ``_rebase_if_deep``); where CRIU cannot, ``ForkError(step="depth")``
is raised on entry and ws is left untouched.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Self

from .adopt import adopt
from .errors import SpeculationError

if TYPE_CHECKING:
    from ..runtime.result import Result
    from ..runtime.shell import Shell
    from ..runtime.workspace import Workspace

__all__ = ["Speculation"]


# What a block calls on its workspace. Checked by name, not by class: Workspace.speculate()
# makes blocks, so this module stands below runtime/workspace.py and does not import it.
_WORKSPACE_METHODS = ("fork", "adopt", "shell")


class _RolledBack(Exception):
    """Raised by :meth:`Speculation.rollback` to leave the block; swallowed by ``__exit__``."""


class Speculation:
    """One speculation block over ``ws``; use as a context manager (see the module doc)."""

    def __init__(self, ws: Workspace) -> None:
        if not all(callable(getattr(ws, m, None)) for m in _WORKSPACE_METHODS):
            raise SpeculationError(f"speculate needs a Workspace, got {type(ws).__name__}")
        self.base = ws
        self.ws: Workspace | None = None  #: the fork the block's calls run on
        self.outcome: str | None = None  #: "committed" or "rolled back" once the block ended
        self._entered = False
        self._shells: dict[int, Shell] = {}

    # -- lifetime -------------------------------------------------------------------------
    def __enter__(self) -> Self:
        if self._entered or self.outcome is not None:
            raise SpeculationError("a speculation block can be entered once; call ws.speculate() again")
        self.ws = self.base.fork(1)[0]
        self._entered = True
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if not self._entered or self.outcome is not None:
            return False
        if et is None:
            self._commit()
            return False
        self._rollback()
        return et is _RolledBack

    def _commit(self) -> None:
        kid = self.ws
        assert kid is not None  # __exit__ of an entered block
        self.outcome = "committed"
        adopt(self.base, kid)

    def _rollback(self) -> None:
        kid = self.ws
        assert kid is not None  # __exit__ of an entered block
        self.outcome = "rolled back"
        kid.close()

    def rollback(self) -> None:
        """Drop everything the block did and leave the block (ws as it was before it)."""
        if not self._entered or self.outcome is not None:
            raise SpeculationError("rollback() is only possible inside the speculation block")
        raise _RolledBack()

    # -- conveniences ---------------------------------------------------------------------
    def _live(self) -> Workspace:
        if not self._entered or self.outcome is not None or self.ws is None:
            raise SpeculationError("the speculation block has ended; its fork is gone")
        return self.ws

    def run(self, cmd: str, **kw: object) -> Result:
        """``spec.ws.run(cmd, **kw)``."""
        return self._live().run(cmd, **kw)  # type: ignore[arg-type]

    def shell(self, of: Shell | None = None) -> Shell:
        """The fork's copy of ``of`` (a shell of ws; default: ws's first live shell), or a new
        shell in the fork when ws has none. After a commit ws's ``Shell`` objects continue from
        these copies."""
        fork = self._live()
        if of is None:
            of = next((s for s in self.base.shells if s.alive), None)
        if of is None:
            sh = self._shells.get(0)
            if sh is None or not sh.alive:
                sh = self._shells[0] = fork.shell()
            return sh
        if of not in self.base.shells:
            raise SpeculationError(f"shell {of!r} does not belong to the speculating workspace")
        for sh in fork.shells:
            if sh.id == of.id and sh.alive:
                return sh
        raise SpeculationError(f"shell pid {of.pid} was not alive when the block began; "
                               "it has no copy in the fork")
