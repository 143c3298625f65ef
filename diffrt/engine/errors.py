"""Errors the engine raises at its public API."""

from __future__ import annotations

from diffrt.field_error import FieldError


class EngineConfigError(FieldError):
    """A bad engine setting; ``field`` names it."""


class EngineError(RuntimeError):
    """The engine cannot take this request (closed, or its executor died)."""


class EngineClosedError(EngineError):
    pass


class EngineDeadError(EngineError):
    pass


class EngineRestartingError(EngineDeadError):
    """Fresh workers were still starting when the request's wait for them
    ended (``restart_wait_s``, or its own timeout): retry shortly. An
    ``EngineDeadError``, so code that handles a dead engine handles this too;
    the HTTP server answers it 503 with ``Retry-After``."""


class EngineWarmupError(EngineError):
    """The start-up request failed or did not finish within warmup_timeout_s."""


class InputsFullError(EngineError):
    """The input images of the requests the engine holds leave no room for
    this request's now (``max_pending_input_bytes``): retry once some have
    finished. The HTTP server answers it 429 with ``Retry-After``."""


class DeadlineUnmeetableError(EngineError):
    """``refuse_unmeetable``: with the work queued ahead of it, this request
    would finish after its ``deadline_s``; refused at once instead of served
    late. ``retry_after_s``: about when the queue ahead will have drained
    enough. The HTTP server answers it 429 (``code="deadline_unmeetable"``)
    with ``Retry-After``."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple:  # both arguments survive a pickle (Ray's errors)
        return type(self), (str(self), self.retry_after_s)
