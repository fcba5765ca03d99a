"""What a tool call returns."""

from __future__ import annotations

import os
import signal as _signal
from dataclasses import dataclass

__all__ = ["Result", "exit_code_from_status"]


@dataclass(frozen=True)
class Result:
    """Outcome of one tool call.

    ``exit_code`` follows the shell's convention: the process's exit status, or 128 + N when
    it was killed by signal N (then ``signal`` is N). ``stdout``/``stderr`` hold at most the
    call's ``max_output`` bytes each; ``truncated`` says that more was produced and dropped.
    ``oom_killed`` says the workspace's memory limit killed a process during the call.
    Shell sessions merge stderr into stdout, as a terminal does.
    """

    stdout: bytes
    stderr: bytes
    exit_code: int
    duration: float
    timed_out: bool = False
    truncated: bool = False
    signal: int | None = None
    oom_killed: bool = False

    @property
    def ok(self) -> bool:
        """True when the call exited 0 and was not cut short."""
        return self.exit_code == 0 and not self.timed_out

    @property
    def output(self) -> str:
        """stdout then stderr, decoded leniently: what an agent is shown."""
        return (self.stdout + self.stderr).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        sig = f", signal={_signal.Signals(self.signal).name}" if self.signal else ""
        flags = "".join(
            f", {n}=True" for n in ("timed_out", "truncated", "oom_killed") if getattr(self, n)
        )
        return (f"Result(exit_code={self.exit_code}{sig}, stdout={self.stdout[:60]!r}"
                f"{'...' if len(self.stdout) > 60 else ''}, stderr={self.stderr[:60]!r}, "
                f"duration={self.duration:.4f}{flags})")


def exit_code_from_status(status: int) -> tuple[int, int | None]:
    """(exit_code, signal) from a raw wait status."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return 128 + sig, sig
    return os.WEXITSTATUS(status), None
