"""The rounds the ingress runs on every live Ray Serve model replica through
the ``StatsBoard`` actor (docs/scale-out.md): a Serve handle reaches only the
replica its router picks, so the ingress posts a round on the board for the
replicas it heard from and waits for each one's reply, while every replica
long-polls the board for its next round (``ray_weights.ReplicaWeights``).

What a round asks is its task's business: a weight update's phase
(``ray_weights.WeightsRound``), a sleep or a wake (``ray_sleep.SleepRound``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgspec

from diffrt.engine.weight_sync import Version
from diffrt.serve.errors import ApiError

#: how long one poll of the board waits for a round
POLL_S = 5.0


class RoundReply(msgspec.Struct, frozen=True, kw_only=True):
    """A replica's answer: its checksum(s) and version, or its error
    (``invalid``: the source; ``mismatch``: its ranks disagreed; ``failed``)."""

    version: Version | None = None
    checksum: str | None = None
    rank_checksums: list[str] = []
    #: the check's tensor names (which earlier updates a later one covers)
    names: list[str] = []
    #: what the work reports beside: an adapter update's ``LoraInfo`` as this
    #: replica holds it now, a sleep's or wake's ``SleepReport``
    info: Any = None
    error: str | None = None
    message: str = ""


class BoardRounds:
    """The board's part: rounds posted by the ingress, polled by replicas."""

    def __init__(self) -> None:
        #: the round posted for each replica: (round id, task)
        self._rounds: dict[str, tuple[int, Any]] = {}
        #: the replies in so far, by round id (while the round runs)
        self._replies: dict[int, dict[str, RoundReply]] = {}
        self._count = 0

    async def next_round(self, replica: str, seen: int,
                         wait_s: float = POLL_S) -> tuple[int, Any] | None:
        """The round posted for ``replica`` after round ``seen``, waiting up to ``wait_s``."""
        end = time.monotonic() + wait_s
        while True:
            got = self._rounds.get(replica)
            if got is not None and got[0] > seen:
                return got
            if time.monotonic() >= end:
                return None
            await asyncio.sleep(0.02)

    def answer(self, replica: str, round_id: int, reply: RoundReply) -> None:
        replies = self._replies.get(round_id)
        if replies is not None:
            replies[replica] = reply

    async def run_round(self, task: Any, replicas: list[str],
                        timeout_s: float) -> dict[str, RoundReply]:
        """Post ``task`` to ``replicas``; their replies once all answered (or
        those in by ``timeout_s``)."""
        self._count += 1
        rid = self._count
        replies = self._replies[rid] = {}
        for replica in replicas:
            self._rounds[replica] = (rid, task)
        end = time.monotonic() + timeout_s
        try:
            while len(replies) < len(replicas) and time.monotonic() < end:
                await asyncio.sleep(0.02)
            return dict(replies)
        finally:
            del self._replies[rid]
            for replica in replicas:
                if self._rounds.get(replica, (0,))[0] == rid:
                    del self._rounds[replica]


async def live_replicas(board: Any) -> list[str]:
    """The replicas the board heard from lately (``StatsBoard.snapshot``);
    503 when none did."""
    live = [name for name, _ in await board.snapshot.remote()]
    if not live:
        raise ApiError(503, "no model replica reported within the last seconds",
                       code="engine_down")
    return live


def replica_states(replies: dict[str, RoundReply], live: list[str],
                   done: Callable[[RoundReply], str]) -> str:
    """Each replica's state after a round that split them, for the 503:
    ``done(reply)`` for those whose work went through, else their error."""
    return "; ".join(
        f"{r}: " + (f"version {replies[r].version!r} ({done(replies[r])})" if r in replies
                    and replies[r].error is None else
                    f"version {replies[r].version!r} ({replies[r].error}: "
                    f"{replies[r].message})" if r in replies else "no answer")
        for r in live)


__all__ = ["POLL_S", "BoardRounds", "RoundReply", "live_replicas", "replica_states"]
