"""The base of every error that names the field a user can fix.

A request field (``InvalidRequestError``), an engine setting
(``EngineConfigError``), a parallel split (``ParallelConfigError``) and a
value that breaks its declaration (``DeclaredValueError``) are refused the
same way: ``field`` names what to change and ``reason`` says why, so a
surface can point at the field without parsing the message (the HTTP server
answers ``param``, the CLI names the flag). A leaf every layer may import.
"""

from __future__ import annotations


class FieldError(ValueError):
    """A value the user can fix. ``str(error)`` is ``"field: reason"`` unless
    ``message`` says it whole."""

    def __init__(self, field: str, reason: str, *, message: str | None = None) -> None:
        super().__init__(f"{field}: {reason}" if message is None else message)
        self.field = field
        self.reason = reason

    def __reduce__(self) -> tuple:  # the field survives a pickle (worker and Ray errors)
        return type(self), (self.field, self.reason)


__all__ = ["FieldError"]
