import os
from collections.abc import Sequence

# A path as os.fsencode takes it.
_Path = str | bytes | os.PathLike[str]

PROTO: dict[str, int]

RESOLVE_NO_XDEV: int
RESOLVE_NO_MAGICLINKS: int
RESOLVE_NO_SYMLINKS: int
RESOLVE_BENEATH: int
RESOLVE_IN_ROOT: int

KCMP_FILE: int
KCMP_VM: int

def clone_exec(flags: int, path: _Path, argv: list[str], envp: list[str], stdio: Sequence[int],
               ctl: int) -> tuple[int, int]: ...
def openat2(dirfd: int, path: _Path, flags: int, mode: int = 0, resolve: int = 0) -> int: ...
def overlay_mount_fd(lowers: list[str], upper: _Path, work: _Path) -> int: ...
def kcmp(pid1: int, pid2: int, typ: int, idx1: int, idx2: int) -> int: ...
