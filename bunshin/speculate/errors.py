"""The exceptions speculation raises (all :class:`bunshin.BunshinError` subclasses)."""

from __future__ import annotations

from ..errors import BunshinError

__all__ = ["SpeculationError"]


class SpeculationError(BunshinError):
    """Speculation was misused (a finished block reused, a bad predictor or ``max_inflight``)."""
