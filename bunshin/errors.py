"""The exceptions Bunshin raises.

Every error a user can cause is a :class:`BunshinError` subclass whose message says what was
wrong and what to do about it. Errors from the kernel are translated at the boundary.
"""

from __future__ import annotations

__all__ = [
    "BunshinError",
    "UnsupportedKernel",
    "PermissionDenied",
    "RootfsError",
    "IsolationError",
    "LimitError",
    "OutOfResources",
    "WorkspaceClosed",
    "WorkspaceDied",
    "SpawnError",
    "ToolCallError",
    "ProtocolError",
    "CgroupError",
    "ForkError",
    "ShellExited",
    "CriuError",
    "ImageError",
    "LayerMissing",
    "LayerCorrupt",
    "ForeignHost",
    "CheckpointError",
    "ConfigError",
]


class BunshinError(Exception):
    """Base class of every error Bunshin raises on purpose."""


class UnsupportedKernel(BunshinError):
    """The running kernel lacks a feature Bunshin needs (see ``bunshin doctor``)."""


class PermissionDenied(BunshinError):
    """Bunshin needs root (CAP_SYS_ADMIN) for namespaces, mounts and cgroups."""


class RootfsError(BunshinError):
    """The rootfs given to ``Workspace.create`` cannot be used (missing, unreadable, malformed)."""


class IsolationError(BunshinError, ValueError):
    """``isolation`` is not ``"trusted"`` or ``"sandbox"``, or a sandbox cannot be made for this
    rootfs (a layer whose file system has no idmapped mounts)."""


class LimitError(BunshinError):
    """A resource limit has a value that cannot be applied (negative, wrong type, too small)."""


class OutOfResources(BunshinError):
    """The trainer or the machine has no room for another workspace: descriptors, processes or
    the state file system's space (the message names which and how much is in use). Nothing was
    made; the existing workspaces keep working. Close some, or raise that limit."""


class WorkspaceClosed(BunshinError):
    """The workspace was closed; create a new one or fork a live one."""


class WorkspaceDied(BunshinError):
    """The workspace's init exited unexpectedly (killed from outside, or the host OOM killer)."""


class SpawnError(BunshinError):
    """A process could not be started inside the workspace (not found, not executable, bad cwd)."""


class ToolCallError(BunshinError):
    """A tool call was malformed (wrong argument types, bad timeout)."""


class ProtocolError(BunshinError):
    """The control channel to the workspace's init carried something unexpected."""


class CgroupError(BunshinError):
    """A cgroup could not be created, configured or removed."""


class ForkError(BunshinError):
    """A workspace could not be forked; the source is left running and intact.

    ``pid`` (host pid), ``step`` (what was being done) and ``errno`` say where, when known.
    ``transient``: what was refused passes by itself once the workspace runs again (a TCP
    connection closing), so the same fork may succeed a moment later.
    """

    def __init__(self, msg: str, *, pid: int | None = None, step: str | None = None,
                 errno: int | None = None, transient: bool = False) -> None:
        super().__init__(msg)
        self.pid, self.step, self.errno, self.transient = pid, step, errno, transient


class ShellExited(BunshinError):
    """The shell session ended (``exit``, killed); open a new one with ``ws.shell()``."""


class CriuError(UnsupportedKernel):
    """No usable CRIU (missing, older than 4.0, or provisioning failed); see ``bunshin doctor``."""


class ImageError(BunshinError):
    """A CRIU image directory is missing, incomplete, corrupt, not Bunshin's, or made for files
    that are no longer there; the directory is left as it was."""


class LayerMissing(ImageError):
    """A rootfs layer an image stands on is not on this node and no source given has it; the
    message names its ``digest`` and where it was looked for."""

    def __init__(self, msg: str, *, digest: str | None = None) -> None:
        super().__init__(msg)
        self.digest = digest


class LayerCorrupt(ImageError):
    """A rootfs layer fetched from a source does not have the content digest it was asked for
    (or the stream carrying it is broken); nothing of it was kept."""

    def __init__(self, msg: str, *, digest: str | None = None) -> None:
        super().__init__(msg)
        self.digest = digest


class ForeignHost(ImageError):
    """An image made on the host's own system (the default rootfs) is loaded on a host whose
    system differs (another OS release or package set): its processes would see other files."""


class CheckpointError(BunshinError):
    """CRIU failed to dump or restore a workspace; ``log`` is the path of its log (kept)."""

    def __init__(self, msg: str, *, log: str | None = None) -> None:
        super().__init__(msg)
        self.log = log


class ConfigError(BunshinError, ValueError):
    """A ``BUNSHIN_*`` environment variable has a value that cannot be parsed."""
