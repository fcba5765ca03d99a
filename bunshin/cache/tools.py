"""The tool registry: how a :class:`ToolCall` becomes a workspace action.

A tool is ``fn(ctx, **args) -> Result | bytes | str | None`` where ``ctx`` is a
:class:`ToolContext` (``ctx.ws``, the session's workspace, and ``ctx.shell()``, its persistent
shell). ``bytes``/``str`` become a successful result with that stdout; ``None`` an empty one.
Built in: ``bash`` (``command``; runs in the session's shell: cd and variables persist),
``read_file`` (``path``), ``write_file`` (``path``, ``content``: str), ``python`` (``code``;
``python3 -c`` through ``ws.exec``). A tool may also be a coroutine function, for
:func:`arun_tool`.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..runtime.result import Result
from .errors import InvalidToolCall, UnknownTool
from .toolcall import ToolCall

if TYPE_CHECKING:
    from ..runtime.shell import Shell
    from ..runtime.workspace import Workspace

__all__ = ["BUILTIN_TOOLS", "ToolContext", "ToolFn", "arun_tool", "run_tool"]


class ToolContext:
    """What a tool function gets: the workspace and the session's persistent shell."""

    def __init__(self, ws: Workspace, shell: Callable[[], Shell]) -> None:
        self.ws = ws
        self._shell = shell

    def shell(self) -> Shell:
        """The session's persistent shell (opened on first use)."""
        return self._shell()


ToolFn = Callable[..., Result | bytes | str | None]


def _need_str(call: str, args: Mapping[str, Any], key: str) -> str:
    v = args.get(key)
    if not isinstance(v, str):
        raise InvalidToolCall(f"tool {call!r}: argument {key!r} must be a str, got {v!r}")
    return v


def _only(call: str, args: Mapping[str, Any], keys: tuple[str, ...]) -> None:
    extra = sorted(set(args) - set(keys))
    if extra:
        raise InvalidToolCall(f"tool {call!r}: unknown argument(s) {extra}; expected {list(keys)}")


def _bash(ctx: ToolContext, **args: Any) -> Result:
    _only("bash", args, ("command",))
    return ctx.shell().run(_need_str("bash", args, "command"))


def _read_file(ctx: ToolContext, **args: Any) -> bytes:
    _only("read_file", args, ("path",))
    return ctx.ws.read_file(_need_str("read_file", args, "path"))


def _write_file(ctx: ToolContext, **args: Any) -> None:
    _only("write_file", args, ("path", "content"))
    ctx.ws.write_file(_need_str("write_file", args, "path"), _need_str("write_file", args, "content"))


def _python(ctx: ToolContext, **args: Any) -> Result:
    _only("python", args, ("code",))
    return ctx.ws.exec(["python3", "-c", _need_str("python", args, "code")])


BUILTIN_TOOLS: dict[str, ToolFn] = {
    "bash": _bash, "read_file": _read_file, "write_file": _write_file, "python": _python,
}


async def _abash(ctx: ToolContext, **args: Any) -> Result:
    _only("bash", args, ("command",))
    return await ctx.shell().arun(_need_str("bash", args, "command"))


async def _apython(ctx: ToolContext, **args: Any) -> Result:
    _only("python", args, ("code",))
    return await ctx.ws.aexec(["python3", "-c", _need_str("python", args, "code")])


# the built-in tools whose calls the event loop runs (the others run in Bunshin's threads)
_ON_THE_LOOP: dict[ToolFn, Callable[..., Awaitable[Result]]] = {_bash: _abash, _python: _apython}


def run_tool(tools: Mapping[str, ToolFn], ctx: ToolContext, call: ToolCall) -> Result:
    """Execute ``call`` with its registered tool; the outcome as a :class:`Result`."""
    fn = _tool(tools, call)
    t0 = time.monotonic()
    return _as_result(call, fn(ctx, **call.args), time.monotonic() - t0)


async def arun_tool(tools: Mapping[str, ToolFn], ctx: ToolContext, call: ToolCall) -> Result:
    """:func:`run_tool` for asyncio: the built-in ``bash`` and ``python`` tools and any tool
    that is a coroutine function are awaited; other tools run in Bunshin's threads."""
    from ..runtime import aio

    fn = _tool(tools, call)
    t0 = time.monotonic()
    if fn in _ON_THE_LOOP:
        out: Any = await _ON_THE_LOOP[fn](ctx, **call.args)
    elif inspect.iscoroutinefunction(fn):
        out = await fn(ctx, **call.args)
    else:
        out = await aio.in_thread(lambda: fn(ctx, **call.args))
    return _as_result(call, out, time.monotonic() - t0)


def _tool(tools: Mapping[str, ToolFn], call: ToolCall) -> ToolFn:
    fn = tools.get(call.name)
    if fn is None:
        raise UnknownTool(f"no tool named {call.name!r}; registered: {sorted(tools)}")
    return fn


def _as_result(call: ToolCall, out: Any, dt: float) -> Result:
    if isinstance(out, Result):
        return out
    if out is None:
        return Result(b"", b"", 0, dt)
    if isinstance(out, str):
        out = out.encode("utf-8")
    if isinstance(out, (bytes, bytearray, memoryview)):
        return Result(bytes(out), b"", 0, dt)
    raise InvalidToolCall(f"tool {call.name!r} returned {type(out).__name__}; "
                          "expected Result, bytes, str or None")
