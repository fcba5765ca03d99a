"""An image's own settings (its config's ``Env``, ``WorkingDir``, ``User``, ``Entrypoint``
and ``Cmd``) and the user they name, resolved in the image's own /etc/passwd and /etc/group.

A workspace made from an image runs its tool calls with the image's environment, working
directory and user, as ``docker run`` / ``podman run`` would; ``Workspace.create`` arguments
override each. ``Entrypoint`` + ``Cmd`` are not started: a workspace's processes are the ones
its user starts, and an agent image's command is usually an interactive shell that would exit
with no terminal; they are kept as ``ws.image_cmd`` for whoever wants the image's service.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import RootfsError

__all__ = ["ImageConfig", "UnknownUser", "User", "resolve_user"]

MAX_GROUPS = 64  # what one spawn request carries (proto.h BX_MAX_GROUPS)


class UnknownUser(RootfsError):
    """The user (or group) an image or ``Workspace.create(user=)`` names is not in the image's
    /etc/passwd (or /etc/group)."""


@dataclass(frozen=True)
class ImageConfig:
    """What an OCI or docker image's config says its container runs with."""

    env: tuple[tuple[str, str], ...] = ()
    workdir: str | None = None
    user: str | None = None
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()

    @classmethod
    def of_image(cls, doc: Any) -> ImageConfig:
        """From an image config JSON document (its ``config`` object; anything else: empty)."""
        c = doc.get("config") if isinstance(doc, dict) else None
        if not isinstance(c, dict):
            return cls()
        env = []
        for entry in c.get("Env") or ():
            if isinstance(entry, str) and "=" in entry:
                k, v = entry.split("=", 1)
                if k:
                    env.append((k, v))
        workdir = c.get("WorkingDir")
        user = c.get("User")
        return cls(env=tuple(env),
                   workdir=workdir if isinstance(workdir, str) and workdir.startswith("/") else None,
                   user=user if isinstance(user, str) and user else None,
                   entrypoint=_strings(c.get("Entrypoint")), cmd=_strings(c.get("Cmd")))

    @property
    def command(self) -> tuple[str, ...]:
        """Entrypoint followed by Cmd: the argv ``docker run IMAGE`` starts."""
        return self.entrypoint + self.cmd

    def to_dict(self) -> dict:
        return {"env": [list(p) for p in self.env], "workdir": self.workdir, "user": self.user,
                "entrypoint": list(self.entrypoint), "cmd": list(self.cmd)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ImageConfig:
        return cls(env=tuple((str(k), str(v)) for k, v in d.get("env") or ()), workdir=d.get("workdir"),
                   user=d.get("user"), entrypoint=tuple(d.get("entrypoint") or ()),
                   cmd=tuple(d.get("cmd") or ()))


def _strings(v: Any) -> tuple[str, ...]:
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(v)
    return ()


@dataclass(frozen=True)
class User:
    """The ids a tool call runs with: ``uid``, primary ``gid``, supplementary ``groups``, and
    ``home`` from /etc/passwd ("/" when the uid has no entry there)."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    home: str | None = None

    def to_dict(self) -> dict:
        return {"uid": self.uid, "gid": self.gid, "groups": list(self.groups), "home": self.home}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> User:
        return cls(uid=int(d["uid"]), gid=int(d["gid"]), groups=tuple(int(g) for g in d["groups"]),
                   home=d.get("home"))


def _entries(data: bytes | None) -> list[list[str]]:
    if not data:
        return []
    out = []
    for line in data.decode("utf-8", "replace").splitlines():
        if line and not line.startswith("#"):
            out.append(line.split(":"))
    return out


def _id(s: str) -> int | None:
    return int(s) if s.isdigit() and int(s) < 2**32 - 1 else None


def resolve_user(spec: str, passwd: bytes | None, group: bytes | None, source: str) -> User:
    """``spec`` (``name``, ``uid``, ``name:group``, ``uid:gid``, …) as Docker reads an image's
    User: names are looked up in the image's ``passwd`` and ``group`` files; a uid with no
    entry runs with gid 0; with no group given, the user's supplementary groups are the
    groups that list its name."""
    if not isinstance(spec, str) or not spec or spec.count(":") > 1:
        raise UnknownUser(f"user {spec!r} (from {source}) must be 'name', 'uid', 'name:group' or 'uid:gid'")
    name, _, grp = spec.partition(":")
    uid = _id(name)
    pw = None
    for e in _entries(passwd):
        if len(e) >= 4 and (e[0] == name or (uid is not None and _id(e[2]) == uid)):
            pw = e
            break
    if pw is None and uid is None:
        raise UnknownUser(f"user {name!r} (from {source}) is not in the image's /etc/passwd; "
                          f"name a user the image has, or a numeric uid")
    if pw is not None:
        uid_, gid_ = _id(pw[2]), _id(pw[3])
        if uid_ is None or gid_ is None:
            raise UnknownUser(f"user {name!r} (from {source}): its /etc/passwd entry {':'.join(pw)!r} is malformed")
        uid, gid, home = uid_, gid_, (pw[5] if len(pw) > 5 and pw[5] else None)
    else:
        assert uid is not None
        gid, home = 0, "/"  # as runc gives a uid with no entry
    groups: list[int] = []
    if grp:
        gid_arg = _id(grp)
        found = next((e for e in _entries(group) if len(e) >= 3 and (e[0] == grp or (gid_arg is not None
                                                                               and _id(e[2]) == gid_arg))), None)
        if found is None and gid_arg is None:
            raise UnknownUser(f"group {grp!r} (from {source}) is not in the image's /etc/group; "
                              f"name a group the image has, or a numeric gid")
        if found is not None:
            gid = _id(found[2]) or 0
        elif gid_arg is not None:
            gid = gid_arg
    elif pw is not None:
        for e in _entries(group):
            if len(e) >= 4 and pw[0] in e[3].split(",") and (g := _id(e[2])) is not None and g != gid:
                groups.append(g)
    if len(groups) > MAX_GROUPS:
        raise UnknownUser(f"user {spec!r} (from {source}) is in {len(groups)} groups; at most {MAX_GROUPS} "
                          "are carried")
    return User(uid=uid, gid=gid, groups=tuple(sorted(set(groups))), home=home)
