"""``POST /sleep`` and ``POST /wake_up`` across Ray Serve's model replicas
(docs/scale-out.md), on the weight updates' rounds (``ray_rounds.py``): the
ingress posts one ``SleepRound`` to every live replica through the
``StatsBoard``, each replica's round thread (``ReplicaWeights``) puts its
engine to sleep (``engine.sleep(level)``, once its running requests finish)
or wakes it, and the ingress answers once every one replied.

The board also keeps the deployment's state (``SleepState``: the level it
sleeps at, or None), set before the round goes out, so that

- the ingress decides as the single server does (``sleep_requests``: a
  request waits in its replica's engine, or is refused at the ingress with
  503 ``sleeping`` and ``Retry-After``) and ``/health`` says sleeping, from
  the board and not from the replicas' statistics, a second behind;
- a replica Ray starts while the deployment sleeps (a replacement,
  autoscaling) goes to sleep before it serves (``follow``), and a replica
  that missed a round (it failed, or started during it) follows between
  rounds, as it catches up with weight updates.

A round that does not reach every replica answers 503 ``partially_asleep``
naming each replica's state (as a weight update's 503 does); the state on
the board stays what the caller asked, so the replicas that failed keep
trying between rounds, and ``POST /sleep`` or ``POST /wake_up`` again
settles it. A round every replica refused changes nothing: the state goes
back to what it was, and the answer is the refusal.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from diffrt.engine.weights.update import WeightUpdateError
from diffrt.serve.errors import ApiError
from diffrt.serve.ray_rounds import RoundReply, live_replicas, replica_states

logger = logging.getLogger(__name__)

#: how long the ingress waits for every replica to sleep (its running
#: requests finish first) or wake
ROUND_TIMEOUT_S = 600.0


class SleepRound(msgspec.Struct, frozen=True, kw_only=True):
    """Sleep at ``level`` (1 or 2), or wake (None)."""

    level: int | None


class SleepState:
    """The board's part: the level the deployment sleeps at, or None."""

    _sleep_level: int | None = None

    def sleep_level(self) -> int | None:
        return self._sleep_level

    def set_sleep_level(self, level: int | None) -> int | None:
        """Set the deployment's state; answers the one it replaces."""
        before, self._sleep_level = self._sleep_level, level
        return before


def handle(engine: Any, task: SleepRound) -> RoundReply:
    """A replica's work for one round: its engine's ``SleepReport`` as
    ``info``, its weights version, or the error."""
    try:
        report = engine.wake() if task.level is None else engine.sleep(task.level)
        return RoundReply(version=engine.weights_version, info=report)
    except (WeightUpdateError, ValueError) as exc:  # quantized or offloaded weights
        error, message = "invalid", str(exc)
    except Exception as exc:
        logger.exception("%s failed", "waking" if task.level is None else "sleeping")
        error, message = "failed", f"{type(exc).__name__}: {exc}"
    return RoundReply(version=engine.weights_version, error=error, message=message)


def follow(engine: Any, level: int | None) -> None:
    """Bring a replica's engine to the deployment's state: asleep at
    ``level``, or awake (a replica that started while the deployment slept,
    or missed a round)."""
    if (level is not None) == engine.sleeping:
        return
    reply = handle(engine, SleepRound(level=level))
    if reply.error is None:
        logger.info("following the deployment: %s", "awake" if level is None
                    else f"asleep at level {level}")


async def sleep_everywhere(board: Any, level: int) -> dict[str, Any]:
    """``POST /sleep?level=``'s answer on Ray Serve (see the module): the
    single server's fields summed over the replicas, and each one's."""
    replies = await _round(board, level)
    return {"sleeping": True, "level": level,
            "freed_bytes": sum(r.info.freed_bytes for r in replies.values()),
            "pinned_bytes": sum(r.info.pinned_bytes for r in replies.values()),
            "replicas": {name: {"freed_bytes": r.info.freed_bytes,
                                "pinned_bytes": r.info.pinned_bytes}
                         for name, r in replies.items()}}


async def wake_everywhere(board: Any) -> dict[str, Any]:
    """``POST /wake_up``'s answer on Ray Serve; after a level-2 sleep every
    replica is back on the model folder's transformer (version 0), which the
    board's kept updates then forget."""
    replies = await _round(board, None)
    if any(r.info.reloaded for r in replies.values()):
        await board.forget_weights.remote()
    versions = {repr(r.version): r.version for r in replies.values()}
    return {"sleeping": False,
            "restored_bytes": sum(r.info.restored_bytes for r in replies.values()),
            "weights_version": next(iter(versions.values())) if len(versions) == 1
            else "mixed",
            "replicas": {name: {"restored_bytes": r.info.restored_bytes,
                                "weights_version": r.version}
                         for name, r in replies.items()}}


async def _round(board: Any, level: int | None) -> dict[str, RoundReply]:
    """One round on every live replica: each one's reply, once all succeeded."""
    live = await live_replicas(board)
    before = await board.set_sleep_level.remote(level)
    replies: dict[str, RoundReply] = await board.run_round.remote(
        SleepRound(level=level), live, ROUND_TIMEOUT_S)
    done = {r: replies[r] for r in live if r in replies and replies[r].error is None}
    what = "wake" if level is None else f"sleep (level {level})"
    if len(done) == len(live):
        logger.info("%s on %d replica(s)", what, len(live))
        return done
    if not done and len(replies) == len(live):  # every replica refused: none changed
        await board.set_sleep_level.remote(before)
        replica, reply = next((r, a) for r, a in sorted(replies.items()) if a.error)
        if reply.error == "invalid":
            raise ApiError(400, f"{reply.message} (replica {replica})", code="invalid_value")
        raise ApiError(503, f"{what} failed on replica {replica}: {reply.message}; nothing "
                            "changed", code="engine_down")
    states = replica_states(replies, live, lambda r: "awake" if level is None else "asleep")
    raise ApiError(503, f"the {what} did not reach every replica (those that missed it "
                        f"follow between rounds; POST /sleep or /wake_up again): {states}",
                   code="partially_asleep")


__all__ = ["ROUND_TIMEOUT_S", "SleepRound", "SleepState", "follow", "handle",
           "sleep_everywhere", "wake_everywhere"]
