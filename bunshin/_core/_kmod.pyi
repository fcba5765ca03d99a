from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

ABI_VERSION: int
NR: dict[str, int]
FORK_MAX_CHILDREN: int
FORK_IN_PARENT: int
RUN_MAX_CALLS: int
RUN_MAX_DATA: int
RUN_SYSCALLS: frozenset[int]
RUN_ARG_RESULT: tuple[int, ...]
RUN_ARG_DATA: tuple[int, ...]
RUN_OK_ANY: int
MAX_PIDS: int
REPARENT_TRACED: int

def get_version(fd: int) -> tuple[int, int, int]: ...
def share_stats(fd: int, pids: npt.ArrayLike) -> tuple[int, int, int, np.ndarray]: ...
def group_stats(fd: int, pids: npt.ArrayLike, groups: npt.ArrayLike,
                ngroups: int) -> tuple[int, int, int, np.ndarray]: ...
def reparent(fd: int, pid: int, new_parent: int, flags: int = 0) -> int: ...
def fork(fd: int, pid: int, children: Sequence[tuple[int, int, int]], child_tid: int = 0,
         flags: int = 0) -> list[int]: ...
def run(fd: int, pid: int, calls: Sequence[tuple[int, Iterable[int], int, int]],
        data: bytes | bytearray | memoryview | None = None) -> list[int]: ...
def join_session(fd: int, pid: int, session_of: int, pgrp_of: int) -> tuple[int, int]: ...
