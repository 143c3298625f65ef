"""Errors the engine raises at its public API."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine cannot take this request (closed, or its executor died)."""


class EngineClosedError(EngineError):
    pass


class EngineDeadError(EngineError):
    pass


class EngineWarmupError(EngineError):
    """The start-up request failed or did not finish within warmup_timeout_s."""
