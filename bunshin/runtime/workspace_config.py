"""What a workspace is configured with: the settings every fork and restore of it carries."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .cgroup.limits import Limits
from .quota import parse_disk
from .rootfs.image_config import User

__all__ = ["WorkspaceConfig"]


@dataclass(frozen=True)
class WorkspaceConfig:
    """A workspace's settings (``ws.config``): the defaults of its tool calls, its limits and
    host name. Its children, restores and rollbacks have the same."""

    env: Mapping[str, str]  #: every tool call's environment, before its own ``env``
    workdir: str  #: every tool call's working directory, unless it gives ``cwd``
    max_output: int  #: bytes kept of each output stream of a tool call
    limits: Limits = field(default_factory=Limits)
    hostname: str = ""
    run_shell: str = "/bin/sh"  #: what :meth:`Workspace.run` runs its command with (``-c``)
    #: "sandbox": in a user namespace of its own (runtime/userns.py), with container-runtime
    #: defaults (:mod:`bunshin.sandbox`)
    isolation: str = "trusted"
    #: bytes its upper layer may hold written (runtime/quota.py); None: no bound
    disk_limit: int | None = None
    #: the ids its tool calls, shells and spawned processes run with; None: root
    user: User | None = None
    #: the image's Entrypoint + Cmd (not started; ``ws.image_cmd``)
    image_cmd: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))
        object.__setattr__(self, "image_cmd", tuple(self.image_cmd))

    def to_dict(self) -> dict:
        """As an image's metadata holds it (:mod:`bunshin.criu`)."""
        return {"env": dict(self.env), "workdir": self.workdir, "max_output": self.max_output,
                "limits": self.limits.to_dict(), "hostname": self.hostname,
                "run_shell": self.run_shell, "isolation": self.isolation,
                "disk_limit": self.disk_limit,
                "user": self.user.to_dict() if self.user is not None else None,
                "image_cmd": list(self.image_cmd)}

    @classmethod
    def from_dict(cls, d: dict) -> WorkspaceConfig:
        return cls(env=d["env"], workdir=d["workdir"], max_output=d["max_output"],
                   limits=Limits.from_dict(d["limits"]), hostname=d["hostname"],
                   run_shell=d["run_shell"], isolation=d.get("isolation", "trusted"),
                   # an image made before disk limits: the default's
                   disk_limit=d["disk_limit"] if "disk_limit" in d else parse_disk(None),
                   user=User.from_dict(d["user"]) if d.get("user") else None,
                   image_cmd=tuple(d.get("image_cmd") or ()))
