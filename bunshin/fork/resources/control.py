"""The init's own descriptors: its control socket (replaced by REROOT in the forked init), its
signalfd (reads the reading task's signals, so a copy works), its log and /dev/null."""

from __future__ import annotations

from types import SimpleNamespace

OPS = SimpleNamespace(
    kind="init-control",
    claims=lambda proc, f: proc.is_init,
    fixup=lambda ctx, proc, r, f: None,  # the init is never fixed up by injection
)
