"""``POST /v1/weights`` and ``PUT /v1/loras/{name}`` across Ray Serve's model
replicas (docs/scale-out.md): every live replica ends on the new version, or
every one keeps the old weights (or adapter factors).

A Serve handle reaches whichever replica its router picks, so the rounds go
through the ``StatsBoard`` actor the replicas already publish to (its
``WeightRounds`` part; the rounds themselves are ``ray_rounds.py``): the
ingress posts a round for the replicas the board heard from within
``STALE_AFTER_S`` and waits for each one's reply; every replica long-polls
the board for its next round (``ReplicaWeights``, a thread of its own beside
the statistics', which also takes ``POST /sleep``'s and ``POST /wake_up``'s
rounds: ``ray_sleep.py``).

1. ``check``: each replica reads the source (a path inside ``--weights-dir``
   on its node, or the uploaded tensors, put once into Ray's object store by
   the ingress), keeps what it read and answers its checksum (the one the
   engine's update reports) and its current version, changing nothing. Any
   failure, a replica that does not answer, or checksums that differ (from
   each other, or from the upload's) refuse the update: 400 / 503 / 409, as
   the single-server route, and each replica drops what it read.
2. ``apply``: each replica hands the tensors it read to its engine's
   ``update_weights_report`` (its own ranks' check, its step boundary and
   ``policy``), under the one version the ingress chose; an adapter's to
   ``update_lora`` (a replica without the adapter refuses it in phase 1: 404).
3. ``revert``, only when phase 2 failed on some replica (or one did not
   answer) while others applied: those put back what they had before
   (``ray_kept.py``): the transformer's old values, which its engine's ranks
   kept (``keep_previous``; ``revert_weights``, bit for bit), or the
   adapter's old file, copied before the update. The answer is then the
   failure's refusal ("rolled back on ..."); only a roll-back that fails too
   gives 503 ``weights_partially_updated``, naming each replica's version.
   The board records the reverted update, so a replica whose apply outlived
   the round rolls back when it next looks (``follow``, or the next check).

The board keeps the updates every replica applied (``Committed``; one that
a later update covers name for name goes). Each replica drops its kept copy
when it next looks (or at the next update's check); a replica Ray starts
later (a replacement, autoscaling) applies them before it serves
(``catch_up``); and between rounds each replica applies any it missed (one
that started while an update was between its phases).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Mapping
from typing import Any, Literal

import msgspec
import torch

from diffrt.engine.weight_sync import (
    Version,
    WeightsMismatchError,
    next_version,
    source_checksum,
)
from diffrt.engine.weights.update import WeightUpdateError, read_tensors
from diffrt.serve import ray_sleep
from diffrt.serve.errors import ApiError
from diffrt.serve.protocol import WeightsUpdated
from diffrt.serve.ray_kept import Kept, copy_adapter, drop_copy
from diffrt.serve.ray_rounds import POLL_S, RoundReply, live_replicas, replica_states
from diffrt.serve.ray_weight_board import Committed, WeightRounds

logger = logging.getLogger(__name__)

#: how long the ingress waits for every replica's check, and for its apply
#: (which first lets the running requests finish, under policy "wait")
CHECK_TIMEOUT_S = 60.0
APPLY_TIMEOUT_S = 600.0


class WeightsRound(msgspec.Struct, frozen=True, kw_only=True):
    """One phase of one update, as the board hands it to a replica.
    ``source``: a path, or ``[ObjectRef]`` of the uploaded tensors."""

    update: str
    phase: Literal["check", "apply", "discard", "revert"]
    source: Any = None
    #: the adapter whose factors it replaces (``PUT /v1/loras/{name}``); None:
    #: the transformer's weights
    lora: str | None = None
    #: a check's: the updates rolled back lately (one this replica applied after
    #: its revert round ended goes back before the new one is checked)
    reverted: list[str] = []
    version: Version | None = None
    policy: str = "wait"


class ReplicaWeights:
    """A model replica's side: poll the board, check and apply updates, and
    sleep or wake as the deployment does (``ray_sleep.py``)."""

    def __init__(self, name: str, board: Any, engine: Any, stop: threading.Event) -> None:
        self.name, self.board, self.engine, self._stop = name, board, engine, stop
        #: what phase 1 read, by update id, for phase 2 to apply
        self._read: tuple[str, dict[str, torch.Tensor]] | None = None
        #: the updates applied here (``_key``), to tell which committed ones it missed
        self._applied: set[tuple[str | None, str, str]] = set()
        #: what the last applied update replaced, until the board settles it
        self._kept: Kept | None = None
        self.thread = threading.Thread(target=self._watch, name="diffrt-weights", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def catch_up(self) -> None:
        """Apply the updates the other replicas applied before this one
        started (``Committed``), before it serves: it reads each source again
        and refuses to start (``RuntimeError``) when it reads other bytes."""
        import ray

        try:
            entries: list[Committed] = ray.get(self.board.committed.remote(), timeout=60)
            level: int | None = ray.get(self.board.sleep_level.remote(), timeout=60)
        except Exception:  # no board: no update was made through it
            logger.warning("reading the applied weight updates failed", exc_info=True)
            return
        self.apply_committed(entries)
        ray_sleep.follow(self.engine, level)  # the deployment sleeps: so does this one

    def apply_committed(self, entries: list[Committed]) -> int:
        """From the first of ``entries`` this replica has not applied on,
        apply them in order (a replica that started while an update was
        between its phases missed it, and may have applied later ones since:
        those go again after it); how many it applied."""
        first = next((i for i, e in enumerate(entries) if _key(e) not in self._applied), None)
        for entry in entries[first:] if first is not None else []:
            tensors = read_source(entry.source)
            got = source_checksum(tensors)
            if got != entry.checksum:
                raise RuntimeError(
                    f"weights version {entry.version!r}: this replica read checksum {got}, the "
                    f"other replicas applied {entry.checksum} (the file changed?)")
            self._apply(entry.lora, tensors, entry.version, "wait")
            logger.info("caught up with %s version %r (%s)", entry.lora or "weights",
                        entry.version, got)
        return 0 if first is None else len(entries) - first

    def _check_committed(self) -> None:
        """Between rounds: roll back or settle the update it applied last,
        catch up with any update this replica missed, and sleep or wake as
        the deployment does (a round it missed)."""
        import ray

        try:
            self.follow(*ray.get([self.board.committed.remote(), self.board.reverted.remote(),
                                  self.board.sleep_level.remote()], timeout=POLL_S * 6))
        except Exception:
            logger.exception("catching up with the applied weight updates failed")

    def follow(self, committed: list[Committed], reverted: list[str], level: int | None
               ) -> None:
        """``_check_committed``'s work on what the board holds."""
        if self._kept is not None:
            if self._kept.update in reverted:  # its apply outlived the revert round
                self._revert(self._kept.update, self._kept.lora)
            elif any(e.update == self._kept.update for e in committed):
                self._settle()
        self.apply_committed(committed)
        ray_sleep.follow(self.engine, level)

    def close(self) -> None:
        """The replica goes: remove an adapter copy it kept (the engine's
        ranks drop theirs with the workers)."""
        kept, self._kept = self._kept, None
        if kept is not None:
            drop_copy(kept.lora_copy)

    def _watch(self) -> None:
        import ray

        seen = 0
        while not self._stop.is_set():
            try:
                got = ray.get(self.board.next_round.remote(self.name, seen),
                              timeout=POLL_S * 6)
            except Exception:  # the board may be gone while the app shuts down
                logger.debug("polling the board for weight updates failed", exc_info=True)
                self._stop.wait(1.0)
                continue
            if got is None:
                self._check_committed()
                continue
            seen, task = got
            reply = self.handle(task)
            try:
                ray.get(self.board.answer.remote(self.name, seen, reply), timeout=POLL_S * 6)
            except Exception:
                logger.warning("answering weight update round %d failed", seen, exc_info=True)
        self.close()

    def _version(self, lora: str | None) -> Version:
        """The current version of what ``lora`` names (``KeyError``: no such adapter)."""
        if lora is None:
            version: Version = self.engine.weights_version
            return version
        version = self._lora_info(lora).version
        return version

    def _lora_info(self, lora: str) -> Any:
        info = next((i for i in self.engine.list_loras() if i.name == lora), None)
        if info is None:
            raise KeyError(lora)
        return info

    def _apply(self, lora: str | None, tensors: dict[str, torch.Tensor], version: Version | None,
               policy: str, update: str | None = None) -> RoundReply:
        """Apply an update; for an ``update`` round's, keep what it replaces
        (``Kept``) until the board settles it or has it rolled back."""
        before = self._version(lora)
        if update is not None:
            self._settle()
        copy: tuple[str | None, str] = (None, "")
        if lora is None:
            done = self.engine.update_weights_report(tensors, version=version, policy=policy,
                                                     keep_previous=update is not None)
            reply = RoundReply(version=done.version, checksum=done.checksum,
                               rank_checksums=list(done.rank_checksums))
        else:
            new = source_checksum(tensors)
            if update is not None:  # the update replaces the adapter's file: copy it first
                copy = copy_adapter(self._lora_info(lora).path, new)
            try:
                info = self.engine.update_lora(lora, tensors, version=version)
            except BaseException:
                drop_copy(copy[0])
                raise
            reply = RoundReply(version=info.version, checksum=new, info=info)
        key = (lora, repr(reply.version), str(reply.checksum))
        if update is not None:
            self._kept = Kept(update=update, lora=lora, version=before, key=key,
                              lora_copy=copy[0], why_not=copy[1])
        elif lora is None:
            self._kept = None  # a commit that kept nothing dropped the engine's copy
        self._applied.add(key)
        return reply

    def _settle(self) -> None:
        """Drop what the last update replaced: it stays (or was rolled back)."""
        kept, self._kept = self._kept, None
        if kept is not None:
            drop_copy(kept.lora_copy)
            if kept.lora is None:
                self.engine.forget_previous_weights()

    def _revert(self, update: str, lora: str | None) -> RoundReply:
        """Put back what ``update`` replaced here, when this replica applied it."""
        kept = self._kept
        if kept is None or kept.update != update:
            return RoundReply(version=self._version(lora), info="not updated")
        self._kept = None
        try:
            if kept.lora is None:
                version = self.engine.revert_weights()
            elif kept.lora_copy is None:
                raise WeightUpdateError(f"adapter {kept.lora!r} cannot be rolled back: "
                                        f"{kept.why_not}")
            else:  # the copy becomes the adapter's file (removed when a later update replaces it)
                version = self.engine.update_lora(kept.lora, kept.lora_copy,
                                                  version=kept.version).version
        except BaseException:
            drop_copy(kept.lora_copy)
            raise
        self._applied.discard(kept.key)  # a retry of the same update applies again
        logger.warning("%s rolled back to version %r (update %s did not reach every replica)",
                       kept.lora or "weights", version, update)
        return RoundReply(version=version, info="rolled back")

    def handle(self, task: WeightsRound | ray_sleep.SleepRound) -> RoundReply:
        """One round's work: the phase's reply, or the error that refuses it."""
        if isinstance(task, ray_sleep.SleepRound):
            return ray_sleep.handle(self.engine, task)
        if task.phase != "apply":
            self._read = None
        try:
            if task.phase == "discard":
                return RoundReply(version=self._version(task.lora))
            if task.phase == "revert":
                return self._revert(task.update, task.lora)
            if task.phase == "check":  # a new update: the last one stays, or goes back
                if self._kept is not None and self._kept.update in task.reverted:
                    self._revert(self._kept.update, self._kept.lora)
                self._settle()
                version = self._version(task.lora)
                tensors = read_source(task.source)
                self._read = (task.update, tensors)
                return RoundReply(version=version, checksum=source_checksum(tensors),
                                  names=sorted(tensors))
            read, self._read = self._read, None
            if read is None or read[0] != task.update:
                return RoundReply(version=self._version(task.lora), error="failed",
                                  message="this replica did not check this update")
            return self._apply(task.lora, read[1], task.version, task.policy, task.update)
        except KeyError:
            return RoundReply(error="not_found", message=f"no LoRA adapter named {task.lora!r}")
        except WeightsMismatchError as exc:
            error, message = "mismatch", str(exc)
        except (WeightUpdateError, OSError, ValueError) as exc:  # files, names, shapes
            error, message = "invalid", str(exc)
        except Exception as exc:
            logger.exception("a weight update's %s failed", task.phase)
            error, message = "failed", f"{type(exc).__name__}: {exc}"
        try:
            now: Version | None = self._version(task.lora)
        except KeyError:
            now = None
        return RoundReply(version=now, error=error, message=message)


def _key(entry: Committed) -> tuple[str | None, str, str]:
    return entry.lora, repr(entry.version), entry.checksum


def read_source(source: Any) -> dict[str, torch.Tensor]:
    """A round's tensors: a path's safetensors, or the uploaded ones from
    Ray's object store."""
    if isinstance(source, str):
        return read_tensors(source)
    import ray

    tensors: dict[str, torch.Tensor] = ray.get(source[0])
    return tensors


async def update_everywhere(board: Any, source: str | Mapping[str, torch.Tensor],
                            version: Version | None, policy: str, param: str) -> WeightsUpdated:
    """The ingress's side of ``POST /v1/weights`` (see the module); raises
    ``ApiError`` for a refusal."""
    new, agreed, done = await _two_phases(board, source, version, policy, param, None)
    live = list(done)
    return WeightsUpdated(version=new, checksum=agreed,
                          rank_checksums=[c for r in live for c in done[r].rank_checksums],
                          replica_checksums={r: str(done[r].checksum) for r in live})


async def update_lora_everywhere(board: Any, name: str,
                                 source: str | Mapping[str, torch.Tensor],
                                 version: Version | None, param: str) -> Any:
    """The ingress's side of ``PUT /v1/loras/{name}``, as ``update_everywhere``;
    answers the adapter's ``LoraInfo`` as the first replica holds it."""
    _, _, done = await _two_phases(board, source, version, "wait", param, name)
    return next(iter(done.values())).info


async def _two_phases(board: Any, source: str | Mapping[str, torch.Tensor],
                      version: Version | None, policy: str, param: str, lora: str | None
                      ) -> tuple[Version, str, dict[str, RoundReply]]:
    """Check on every live replica, then apply (see the module): the new
    version, the agreed checksum and each replica's reply, in ``live``'s order."""
    import ray

    live = await live_replicas(board)
    expected = None
    wire: Any = source
    if isinstance(source, Mapping):
        expected = await asyncio.to_thread(source_checksum, source)
        wire = [ray.put(dict(source))]
    update = uuid.uuid4().hex
    checks = await board.run_round.remote(
        WeightsRound(update=update, phase="check", source=wire, lora=lora,
                     reverted=await board.reverted.remote()), live, CHECK_TIMEOUT_S)
    try:
        new = _agreed(checks, live, expected, version, param, lora)
    except BaseException:
        await board.run_round.remote(WeightsRound(update=update, phase="discard", lora=lora),
                                     sorted(checks), CHECK_TIMEOUT_S)
        raise
    applied: dict[str, RoundReply] = await board.run_round.remote(
        WeightsRound(update=update, phase="apply", version=new, policy=policy, lora=lora),
        live, APPLY_TIMEOUT_S)
    done = {r: applied[r] for r in live if r in applied and applied[r].error is None}
    agreed = str(checks[live[0]].checksum)
    if len(done) == len(live) and all(a.checksum == agreed for a in done.values()):
        logger.info("%s version %r applied on %d replica(s) (%s)", lora or "weights", new,
                    len(live), agreed)
        await board.commit.remote(Committed(names=checks[live[0]].names, source=wire,
                                            version=new, checksum=agreed, lora=lora,
                                            update=update))
        return new, agreed, done
    failed = {r: applied.get(r, RoundReply(error="failed", message="no answer in time"))
              for r in live if r not in done}
    failed |= {r: RoundReply(error="mismatch", message=f"applied checksum {a.checksum}, the "
                             f"check agreed on {agreed}")
               for r, a in done.items() if a.checksum != agreed}
    if not done and len(applied) == len(live):  # every replica refused: none changed
        _refuse(failed, param, lora)
    # recorded first: a replica whose apply outlives the round rolls back when it looks
    await board.record_reverted.remote(update)
    reverted: dict[str, RoundReply] = await board.run_round.remote(
        WeightsRound(update=update, phase="revert", lora=lora), list(done),
        APPLY_TIMEOUT_S) if done else {}
    if all(r in reverted and reverted[r].error is None for r in done):
        silent = [r for r in live if r not in applied]
        note = f"; rolled back on {', '.join(done)}" if done else ""
        note += (f"; no answer from {', '.join(silent)} (each rolls back when it next looks, "
                 "if it applied)") if silent else (": every replica keeps its old weights"
                                                   if done else "")
        _refuse(failed, param, lora, note)
    states = replica_states({**failed, **reverted}, live, lambda a: str(a.info))
    raise ApiError(503, f"the update to version {new!r} failed on {', '.join(failed)} and "
                        f"rolling it back failed too: the replicas now differ (update again "
                        f"or restart): {states}", code="weights_partially_updated")


def _agreed(checks: dict[str, RoundReply], live: list[str], expected: str | None,
            version: Version | None, param: str, lora: str | None) -> Version:
    """The new version, once every replica's check agrees; else the refusal."""
    missing = [r for r in live if r not in checks]
    if missing:
        raise ApiError(503, f"replica(s) {', '.join(missing)} did not check the update: "
                            "refused, nothing changed", code="engine_down")
    if any(c.error for c in checks.values()):
        _refuse(checks, param, lora)
    sums = {r: checks[r].checksum for r in live}
    if len(set(sums.values())) > 1 or (expected is not None and sums[live[0]] != expected):
        said = ", ".join(f"{r}: {s}" for r, s in sums.items())
        source = "" if expected is None else f" (the upload's: {expected})"
        raise ApiError(409, f"{param}: the replicas read different bytes{source}: {said}; "
                            "the update is refused and every replica keeps its old weights",
                       param=param, code="weights_checksum_mismatch")
    versions = [checks[r].version for r in live]
    current = versions[0] if len(set(map(repr, versions))) == 1 else (
        max(v for v in versions if isinstance(v, int))
        if all(isinstance(v, int) for v in versions) else "mixed")
    try:
        assert current is not None
        return next_version(current, version)
    except WeightUpdateError as exc:
        raise ApiError(400, f"version: {exc}", param="version", code="invalid_value") from None


def _refuse(replies: dict[str, RoundReply], param: str, lora: str | None,
            rolled_back: str = "") -> None:
    """A replica's refusal as the single-server route answers it (the first
    by name); ``rolled_back`` says what the others undid."""
    replica, reply = next((r, a) for r, a in sorted(replies.items()) if a.error)
    message = f"{param}: {reply.message} (replica {replica}){rolled_back}"
    if reply.error == "not_found":
        raise ApiError(404, reply.message + rolled_back, param="name", code="lora_not_found")
    if reply.error == "mismatch":
        raise ApiError(409, message, param=param, code="weights_checksum_mismatch")
    if reply.error == "invalid":
        raise ApiError(400, message, param=param,
                       code="invalid_weights" if lora is None else "invalid_lora_file")
    raise ApiError(503, f"the update failed on replica {replica}: {reply.message}"
                        f"{rolled_back or '; nothing changed'}", code="engine_down")


__all__ = ["POLL_S", "Committed", "ReplicaWeights", "RoundReply", "WeightRounds", "WeightsRound",
           "read_source", "update_everywhere", "update_lora_everywhere"]
