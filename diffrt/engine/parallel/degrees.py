"""How one request is split over ranks, and the error for a split a model cannot run."""

from __future__ import annotations

from dataclasses import dataclass

from diffrt.field_error import FieldError


class ParallelConfigError(FieldError):
    """A parallel configuration this model cannot run; ``field`` names the
    EngineConfig field to change (the reason, the message, says why in words)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(field, reason, message=reason)


@dataclass(frozen=True)
class ParallelDegrees:
    """How one request is split: CFG branches × ring × Ulysses ranks."""

    cfg: int = 1
    ulysses: int = 1
    ring: int = 1

    @property
    def world_size(self) -> int:
        return self.cfg * self.ring * self.ulysses

    @property
    def sequence_size(self) -> int:
        """Ranks that share one transformer call's image tokens."""
        return self.ring * self.ulysses

    def rank_of(self, c: int, r: int, u: int) -> int:
        return (c * self.ring + r) * self.ulysses + u

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``rank`` -> (cfg index, ring index, Ulysses index)."""
        rest, u = divmod(rank, self.ulysses)
        c, r = divmod(rest, self.ring)
        return c, r, u


__all__ = ["ParallelConfigError", "ParallelDegrees"]
