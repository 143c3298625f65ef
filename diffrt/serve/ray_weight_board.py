"""The statistics board's part in weight updates across Ray Serve replicas
(``ray_weights.py``): the rounds (``BoardRounds``), the updates every replica
applied (``Committed``, for replicas Ray starts later), the updates rolled
back lately (for a replica whose apply outlived its round) and whether the
deployment sleeps (``ray_sleep.SleepState``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from diffrt.engine.weight_sync import Version
from diffrt.serve import ray_sleep
from diffrt.serve.ray_rounds import BoardRounds


class Committed(msgspec.Struct, frozen=True, kw_only=True):
    """An update every replica applied, kept on the board for the replicas
    Ray starts later (a replacement, autoscaling): they apply it at start."""

    names: list[str]
    source: Any
    version: Version
    checksum: str
    lora: str | None = None
    #: the update's id (``WeightsRound.update``)
    update: str = ""


#: how many rolled-back updates the board remembers (for replicas that were late)
REVERTED_KEPT = 32


class WeightRounds(BoardRounds, ray_sleep.SleepState):
    """The board's part: the rounds (``BoardRounds``), the updates every
    replica applied (``Committed``), those rolled back, and whether the
    deployment sleeps."""

    def __init__(self) -> None:
        super().__init__()
        self._committed: list[Committed] = []
        self._reverted: list[str] = []

    def commit(self, entry: Committed) -> None:
        """Record an applied update; those whose every tensor it replaces go."""
        covered = set(entry.names)
        self._committed = [e for e in self._committed
                           if e.lora != entry.lora or not set(e.names) <= covered]
        self._committed.append(entry)

    def committed(self) -> list[Committed]:
        """The updates a replica starting now applies, oldest first."""
        return list(self._committed)

    def record_reverted(self, update: str) -> None:
        self._reverted = [*self._reverted[-(REVERTED_KEPT - 1):], update]

    def reverted(self) -> list[str]:
        """The updates rolled back lately (a replica that applied one late reverts it)."""
        return list(self._reverted)

    def forget_weights(self) -> None:
        """A level-2 sleep: every replica wakes on the model folder's
        transformer (version 0), so a replica starting now applies no
        transformer update (the adapters' stay)."""
        self._committed = [e for e in self._committed if e.lora is not None]


__all__ = ["REVERTED_KEPT", "Committed", "WeightRounds"]
