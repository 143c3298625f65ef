"""A test seam for the weight updates across replicas (``ray_weights.py``):
a statistics board that, once armed, hands the next update's check to one
replica with another source, as if that replica had read other bytes, or
the next apply to one replica under another update's id, which it then
refuses (it did not check that one), as if it had failed to apply.

Its actor class travels to Ray by value (``register_pickle_by_value``): the
workers cannot import this folder's modules."""

from __future__ import annotations

from typing import Any

import msgspec

from diffrt.serve.ray_app import StatsBoard
from diffrt.serve.ray_weights import POLL_S, WeightsRound


class SeamBoard(StatsBoard):
    def __init__(self) -> None:
        super().__init__()
        self._other: list[Any] | None = None
        self._fail_apply = False

    def arm(self, other: list[Any]) -> None:
        """The next check round's first replica gets ``other`` (``[ObjectRef]``)."""
        self._other = other

    def fail_next_apply(self) -> None:
        """The next apply round's first replica fails it (see the module)."""
        self._fail_apply = True

    async def next_round(self, replica: str, seen: int,
                         wait_s: float = POLL_S) -> tuple[int, WeightsRound] | None:
        got = await super().next_round(replica, seen, wait_s)
        if (got is not None and isinstance(got[1], WeightsRound) and got[1].phase == "check"
                and self._other is not None):
            other, self._other = self._other, None
            got = (got[0], msgspec.structs.replace(got[1], source=other))
        if (got is not None and isinstance(got[1], WeightsRound) and got[1].phase == "apply"
                and self._fail_apply):
            self._fail_apply = False
            got = (got[0], msgspec.structs.replace(got[1], update="not-checked"))
        return got
