"""``RemoteWorkspace``: a workspace on a host, usable from any process of the cluster.

A proxy is a host actor handle and an id: it pickles, so it can be passed to Ray tasks and
actors; every method is one call to the host (blocking; ``ray.get``). The process that made a
workspace (``create``, ``fork``, ``snapshot``) owns it and keeps it alive by a lease
(:mod:`.lease`); closing it is the owner's job, and the host reclaims it if the owner dies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

from . import lease
from .errors import ClusterError, HostLost

if TYPE_CHECKING:
    from ..runtime.result import Result

__all__ = ["RemoteShell", "RemoteTemplate", "RemoteWorkspace", "find_host"]


def _get(ref: Any) -> Any:
    import ray

    try:
        return ray.get(ref)
    except (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError) as e:
        raise HostLost(f"the workspace host is gone ({type(e).__name__}); its workspaces with it") from e


def find_host(node_id: str | None = None) -> Any:
    """The host actor of ``node_id`` (made by :func:`~bunshin.cluster.start_hosts`), or of
    this process's node when None."""
    import ray

    from .host import HOST_NAMESPACE, host_name

    node = node_id or ray.get_runtime_context().get_node_id()
    try:
        return ray.get_actor(host_name(node), namespace=HOST_NAMESPACE)
    except ValueError:
        raise ClusterError(f"no workspace host on node {node}; call bunshin.cluster.start_hosts() "
                           "first") from None


class _Remote:
    def __init__(self, host: Any, oid: str) -> None:
        self.host, self.id = host, oid

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def fork(self, n: int = 1) -> list[RemoteWorkspace]:
        """``n`` live copies on the same host (forks stay on their node), owned by this process."""
        ids = _get(self.host.fork.remote(self.id, n, lease.owner_id()))
        lease.hold(self.host, _lease_s(self.host))
        return [RemoteWorkspace(self.host, i) for i in ids]

    def close(self) -> None:
        _get(self.host.close.remote(self.id))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_LEASES: dict[str, float] = {}


def _lease_s(host: Any) -> float:
    key = host._actor_id.hex()
    if key not in _LEASES:
        _LEASES[key] = _get(host.renew.remote(lease.owner_id()))
    return _LEASES[key]


class RemoteWorkspace(_Remote):
    """A :class:`~bunshin.Workspace` held by a :class:`~bunshin.cluster.WorkspaceHost`."""

    @classmethod
    def create(cls, rootfs: Any = None, *, host: Any = None, node: str | None = None, **kw: Any) -> RemoteWorkspace:
        """A new workspace on ``host`` (an actor handle), else on the host of ``node``, else on
        this process's node; ``kw`` as ``Workspace.create``."""
        h = host if host is not None else find_host(node)
        wid = _get(h.create.remote(lease.owner_id(), rootfs, **kw))
        lease.hold(h, _lease_s(h))
        return cls(h, wid)

    def run(self, cmd: str, **kw: Any) -> Result:
        return _get(self.host.run.remote(self.id, cmd, **kw))

    def exec(self, argv: Sequence[str], **kw: Any) -> Result:
        return _get(self.host.exec.remote(self.id, list(argv), **kw))

    def read_file(self, path: str, **kw: Any) -> bytes:
        return _get(self.host.read_file.remote(self.id, path, **kw))

    def write_file(self, path: str, data: bytes | str, **kw: Any) -> None:
        _get(self.host.write_file.remote(self.id, path, data, **kw))

    def shell(self, *, env: Mapping[str, str] | None = None, cwd: str | None = None) -> RemoteShell:
        """A persistent shell session in the workspace."""
        return RemoteShell(self.host, _get(self.host.shell.remote(self.id, env=env, cwd=cwd)))

    def snapshot(self) -> RemoteTemplate:
        """The workspace's current state as a template on its host, owned by this process."""
        tid = _get(self.host.snapshot.remote(self.id, lease.owner_id()))
        lease.hold(self.host, _lease_s(self.host))
        return RemoteTemplate(self.host, tid)


class RemoteTemplate(_Remote):
    """A :class:`~bunshin.Template` held by a host: ``fork(n)`` and ``close()``."""


class RemoteShell(_Remote):
    """A shell session of a remote workspace."""

    def run(self, cmd: str, **kw: Any) -> Result:
        return _get(self.host.shell_run.remote(self.id, cmd, **kw))

    def fork(self, n: int = 1) -> list[RemoteWorkspace]:
        raise ClusterError("a shell cannot be forked; fork its workspace")

    def close(self) -> None:
        _get(self.host.shell_close.remote(self.id))
