"""Tool calls, their canonical form, and the trie's node keys.

Canonical form of a call: the UTF-8 bytes of the JSON array ``[name, args]`` with object keys
sorted, no whitespace (``","`` and ``":"`` separators), non-ASCII characters written as
themselves (not ``\\u`` escapes). Allowed argument values: ``str``, ``int``, ``bool``, ``None``,
lists/tuples (tuples become lists) and dicts with ``str`` keys. **Floats are rejected**: their
text form is not canonical across producers (``1.0`` vs ``1``, rounding); pass numbers as ``int``
or as ``str``. Bytes are rejected (pass ``str``). Strings must be encodable as UTF-8 (no lone
surrogates).

Keys are 16 bytes: ``root = xxh3_128(NAMESPACE ‖ task_id)`` and
``child = xxh3_128(parent ‖ canonical call)``. The task id is part of the root so that
different tasks never share a node.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from .errors import InvalidToolCall

__all__ = ["NAMESPACE", "ToolCall", "as_tool_call", "canonical", "child_key", "root_key"]

NAMESPACE = b"bunshin-prefix-cache/1\x00task:"
"""Prefix of every root key: changing the canonical form means changing this string."""


def _check_value(v: Any, where: str) -> Any:
    if v is None or isinstance(v, (bool, int, str)):
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidToolCall(f"{where}: string is not valid UTF-8 text: {v!r}") from None
        return v
    if isinstance(v, float):
        raise InvalidToolCall(f"{where}: floats are not canonical ({v!r}); pass an int or a str")
    if isinstance(v, (list, tuple)):
        return [_check_value(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, Mapping):
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise InvalidToolCall(f"{where}: object keys must be str, got {k!r}")
            out[k] = _check_value(x, f"{where}.{k}")
        return out
    raise InvalidToolCall(f"{where}: {type(v).__name__} is not allowed in a tool call "
                          "(str, int, bool, None, list, dict only)")


@dataclass(frozen=True)
class ToolCall:
    """One tool call: a tool ``name`` and its JSON-like ``args``.

    ``ToolCall("bash", {"command": "ls"})``; a plain ``str`` passed where a call is expected is
    shorthand for exactly that. Validated on creation (see the module docstring for the rules);
    ``canonical`` is the bytes the trie hashes.
    """

    name: str
    args: Mapping[str, Any] = field(default_factory=dict)
    canonical: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidToolCall(f"tool name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.args, Mapping):
            raise InvalidToolCall(f"tool {self.name!r}: args must be a dict, got {type(self.args).__name__}")
        args = _check_value(self.args, f"tool {self.name!r} args")
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "canonical", canonical(self.name, args))

    def __hash__(self) -> int:
        return hash(self.canonical)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ToolCall) and other.canonical == self.canonical


def canonical(name: str, args: Mapping[str, Any]) -> bytes:
    """The canonical bytes of a call (arguments already checked)."""
    return json.dumps([name, args], sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def as_tool_call(call: ToolCall | str) -> ToolCall:
    """``call`` itself, or ``ToolCall("bash", {"command": call})`` for a str."""
    if isinstance(call, ToolCall):
        return call
    if isinstance(call, str):
        return ToolCall("bash", {"command": call})
    raise InvalidToolCall(f"a tool call must be a ToolCall or a str (bash command), got {type(call).__name__}")


def root_key(task_id: str) -> bytes:
    """Key of the root node of ``task_id``'s trie."""
    if not isinstance(task_id, str) or not task_id:
        raise InvalidToolCall(f"task_id must be a non-empty str, got {task_id!r}")
    return xxhash.xxh3_128_digest(NAMESPACE + task_id.encode("utf-8"))


def child_key(parent: bytes, call: ToolCall) -> bytes:
    """Key of the node reached from ``parent`` by ``call``."""
    return xxhash.xxh3_128_digest(parent + call.canonical)
