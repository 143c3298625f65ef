"""Completing a ``concurrent.futures.Future`` that its waiter may already have
cancelled or timed out: never raises, says whether it took (the pump must
survive every waiter)."""

from __future__ import annotations

import concurrent.futures
from typing import Any

Future = concurrent.futures.Future


def complete(fut: Future, result: Any) -> bool:
    """Resolve ``fut``; False when it was already cancelled/resolved (never raises)."""
    if isinstance(result, BaseException):
        return set_exception(fut, result)
    return set_result(fut, result)


def set_result(fut: Future, value: Any) -> bool:
    try:
        fut.set_result(value)
        return True
    except concurrent.futures.InvalidStateError:
        return False


def set_exception(fut: Future, exc: BaseException) -> bool:
    try:
        fut.set_exception(exc)
        return True
    except concurrent.futures.InvalidStateError:
        return False
