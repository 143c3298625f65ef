"""A bound on the bytes of edit bodies the server holds at once.

Each edit body is bounded (``max_edit_body_bytes``, 32 MiB by default), but
so many may arrive together (``--limit-concurrency`` connections) that their
sum would not fit in memory. The request middleware takes room here for an
edit's body as it arrives (its declared length at once, a chunked one as it
grows) and gives it back once the route has turned the body into the
engine's arrays (``release_body`` in the request's state) or the request
ends; a body that finds no room is refused with 429 and ``Retry-After``, as
other backpressure is. Everything runs on the event loop: no lock.
"""

from __future__ import annotations

from diffrt.serve.errors import ApiError


class BodyBudget:
    """``limit`` bytes shared by the edit bodies being received or parsed."""

    def __init__(self, limit: int, retry_after_s: int = 1):
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.held = 0

    def hold(self) -> BodyHold:
        return BodyHold(self)


class BodyHold:
    """One body's room in a ``BodyBudget``."""

    def __init__(self, budget: BodyBudget):
        self.budget = budget
        self.nbytes = 0

    def grow(self, nbytes: int) -> None:
        """Hold ``nbytes`` in all (no less than held already); ApiError 429
        when the budget has no room for them."""
        more = nbytes - self.nbytes
        if more <= 0:
            return
        budget = self.budget
        if budget.held + more > budget.limit:
            raise ApiError(429, (
                f"edit bodies of {budget.held} bytes are being received or read, and this "
                f"one's {nbytes} would pass max_edit_bytes_in_flight ({budget.limit}); retry "
                "shortly"), code="uploads_full",
                headers={"Retry-After": str(budget.retry_after_s)})
        budget.held += more
        self.nbytes = nbytes

    def release(self) -> None:
        """Give the room back (idempotent)."""
        self.budget.held -= self.nbytes
        self.nbytes = 0


__all__ = ["BodyBudget", "BodyHold"]
