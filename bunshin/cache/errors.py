"""The exceptions the prefix cache raises (all :class:`bunshin.BunshinError` subclasses)."""

from __future__ import annotations

from ..errors import BunshinError

__all__ = ["CacheError", "CacheFormatError", "InvalidToolCall", "UnknownTool"]


class CacheError(BunshinError):
    """The prefix cache was misused or its store cannot be used."""


class CacheFormatError(CacheError):
    """The LMDB file is not a Bunshin prefix cache (corrupt, foreign, or another format
    version). The file is left exactly as it was; pass another path or remove it yourself."""


class InvalidToolCall(CacheError):
    """A tool call cannot be canonicalised (bad name, float or non-JSON argument, bad types)."""


class UnknownTool(InvalidToolCall):
    """A tool call names a tool that is not registered (see ``PrefixCache.register_tool``)."""
