"""``with ws.speculate() as spec:`` — try tool calls on a fork, then keep or drop them.

>>> with ws.speculate() as spec:            # doctest: +SKIP
...     spec.run("make")                     # runs on spec.ws, a fork of ws
...     if spec.run("make test").exit_code:
...         spec.rollback()                  # ws stays exactly as before the block
>>> # leaving the block normally: ws now holds the fork's state (commit)

How: entering freezes ws's state as a template (``ws.snapshot()``) and forks ``spec.ws`` from
it; ws itself is not touched by the block. Commit makes ws *adopt* the fork (no extra fork:
the same ``Workspace`` object and its ``Shell`` objects continue in the fork's state; a
shell opened in the fork becomes one of ws's shells). Rollback closes the fork; if ws itself
was used during the block it is restored from the template (``ws.restore``), so rollback is
exact either way. An exception inside the block rolls back and propagates.

Depth: a snapshot moves ws one pid namespace deeper (the kernel allows 32). A block entered
while ws is still a fresh fork of its template (e.g. right after a rolled-back block) forks
from that template instead, so a loop of rolled-back blocks stays at one depth. A committed
block leaves ws one level deeper: after about 30 commits the snapshot on entry first moves ws
back to the top level through CRIU (runtime/workspace.py, ``_rebase_if_deep``); where CRIU
cannot, ``ForkError(step="depth")`` is raised on entry and ws is left untouched.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Self

from .adopt import adopt, clean_template, is_clean, mark_clean
from .errors import SpeculationError

if TYPE_CHECKING:
    from ..runtime.result import Result
    from ..runtime.shell import Shell
    from ..runtime.template import Template
    from ..runtime.workspace import Workspace

__all__ = ["Speculation"]


# What a block calls on its workspace. Checked by name, not by class: Workspace.speculate()
# makes blocks, so this module stands below runtime/workspace.py and does not import it.
_WORKSPACE_METHODS = ("snapshot", "restore", "adopt", "shell")


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
        self._tpl: Template | None = None
        self._shells: dict[int, Shell] = {}

    # -- lifetime -------------------------------------------------------------------------
    def __enter__(self) -> Self:
        if self._tpl is not None or self.outcome is not None:
            raise SpeculationError("a speculation block can be entered once; call ws.speculate() again")
        ws = self.base
        tpl = clean_template(ws)
        if tpl is None:
            tpl = ws.snapshot()
            mark_clean(ws)
        try:
            self.ws = tpl.fork(1)[0]
        except BaseException:
            tpl.close()
            raise
        self._tpl = tpl
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if self._tpl is None:
            return False
        if et is None:
            self._commit()
            return False
        self._rollback()
        return et is _RolledBack

    def _commit(self) -> None:
        tpl, self._tpl = self._tpl, None
        kid = self.ws
        assert tpl is not None and kid is not None  # __exit__ of an entered block
        try:
            adopt(self.base, kid)
        finally:
            tpl.close()
        self.outcome = "committed"

    def _rollback(self) -> None:
        tpl, self._tpl = self._tpl, None
        kid = self.ws
        assert tpl is not None and kid is not None  # __exit__ of an entered block
        try:
            kid.close()
            if not self.base.closed and not is_clean(self.base):
                self.base.restore(tpl)  # ws was used during the block: put it back exactly
                mark_clean(self.base)
        finally:
            tpl.close()
        self.outcome = "rolled back"

    def rollback(self) -> None:
        """Drop everything the block did and leave the block (ws as it was before it)."""
        if self._tpl is None:
            raise SpeculationError("rollback() is only possible inside the speculation block")
        raise _RolledBack()

    # -- conveniences ---------------------------------------------------------------------
    def _live(self) -> Workspace:
        if self._tpl is None or self.ws is None:
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
