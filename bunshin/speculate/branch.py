"""One speculative branch: a predicted call running on its own fork in a background thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ..cache.toolcall import ToolCall
from ..cache.tools import ToolContext, ToolFn, run_tool
from .adopt import cpu_ns

if TYPE_CHECKING:
    from ..runtime.result import Result
    from ..runtime.shell import Shell
    from ..runtime.workspace import Workspace

__all__ = ["Branch", "shell_in"]


def shell_in(ws: Workspace, pid: int | None) -> Shell:
    """``ws``'s live shell with bash pid ``pid`` (else its first live shell, else a new one)."""
    live = [s for s in ws.shells if s.alive]
    for s in live:
        if s.pid == pid:
            return s
    return live[0] if live else ws.shell()


class Branch:
    """Runs ``call`` on ``kid`` (using the shell that continues bash pid ``shell_pid``)."""

    def __init__(self, call: ToolCall, kid: Workspace, tools: Mapping[str, ToolFn],
                 shell_pid: int | None) -> None:
        self.call = call
        self.kid = kid
        self.result: Result | None = None
        self.error: BaseException | None = None
        self.exec_time = 0.0
        self._shell: Callable[[], Shell] = lambda: shell_in(kid, shell_pid)
        self._tools = tools
        self._thread = threading.Thread(target=self._run, name=f"bunshin-spec-{kid.id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            self.result = run_tool(self._tools, ToolContext(self.kid, self._shell), self.call)
        except BaseException as e:  # noqa: BLE001 - reported to whoever adopts or discards us
            self.error = e
        finally:
            self.exec_time = time.monotonic() - t0

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> float:
        """Wait for the call to finish; returns the seconds waited."""
        t0 = time.monotonic()
        self._thread.join()
        return time.monotonic() - t0

    def discard(self) -> float:
        """Stop and close the fork; returns the CPU seconds it used (wall time without the cpu
        controller). A call still running is killed with its workspace."""
        try:
            used = cpu_ns(self.kid)
        except Exception:  # noqa: BLE001 - accounting must not stop a discard
            used = None
        self.kid.close()
        self._thread.join()
        return self.exec_time if used is None else used / 1e9
