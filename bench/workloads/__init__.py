"""Realistic workloads for the end-to-end rollout benchmark (``bench/e2e.py``).

Each workload is a :class:`Workload`: a :class:`bunshin.rl.Task` (setup tool calls, a ``ready``
probe), one trace of tool calls per group member, and ``params`` stating every parameter
(sizes, step counts, the shared prefix, the divergence point, a think-time suggestion, the
seed, and the source packages with their versions). ``expect`` gives, for each step of each
trace, the exit code a correct run produces (0, a specific failure code, or None: not
checked). Members share their first ``params["shared_prefix_steps"]`` calls and then diverge.

Built from real software available offline:

* ``repo`` (default): more-itertools 10.5.0 from its PyPI sdist as the repository (source and
  real test suite), pytest from PyPI wheels installed offline, ``pip install -e .`` offline,
  and a long-lived Python "language server" holding ASTs of the repository and the stdlib.
* ``terminal``: log analysis with coreutils/grep/awk/sort on a generated nginx access log.
* ``server``: redis-server loaded with users, sessions, a leaderboard and event lists,
  queried and modified with redis-cli and a hand-written Python RESP client.

``make(group_size, seed=0, quick=False)`` builds one; ``verify(workload)`` (check.py) runs
every trace on real workspaces and reports the steps that did not behave as expected.
"""

from __future__ import annotations

from typing import Callable

from ._base import Workload
from .repo import make as make_repo
from .server import make as make_server
from .terminal import make as make_terminal

__all__ = ["DEFAULT", "WORKLOADS", "Workload", "verify"]

WORKLOADS: dict[str, Callable[..., Workload]] = {
    "repo": make_repo,
    "terminal": make_terminal,
    "server": make_server,
}

DEFAULT = "repo"


def verify(workload: Workload, **kw):
    """Run every trace of ``workload`` on a real workspace; see :func:`check.verify`."""
    from .check import verify as _verify

    return _verify(workload, **kw)
