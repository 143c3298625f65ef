"""STEP_BATCH scheduling: continuous batching at denoise-step granularity.

Every tick advances all running requests by one denoise step in one batch —
or by up to ``max_steps_per_tick`` steps when nothing is to be dropped
(admission happens first, every tick): one round trip engine -> worker -> engine then
carries several steps (the worker stops early after a step that finishes a
request or reaches a preview, so every exit still happens at its own step).
A request that arrives meanwhile, or an abort, waits at most that many steps;
the progress of every step is still reported, one item per step.
Requests join at a step boundary when there is capacity and their
step batch key (the pipeline's ``step_batch_key``) equals the running batch's; they leave
when their own step count is reached (counts may differ within a batch), when
they fail, or when aborted. The worker keeps each request's step state, so a
request that leaves without finishing there is listed in the next tick's
``drop_ids``. The optional coalescing window (see ``BaseScheduler``) applies
only when nothing runs: a batch forming from scratch, e.g. after a burst of
requests finished together and their clients send the next ones; joining a
running batch never waits.

``token_budget`` (``max_num_batched_tokens``) bounds the tokens one step
computes: each row's text plus image tokens, summed over the step's rows
(outputs, twice with CFG) — or, where rows of different sizes share one
transformer call padded to the longest (``padded``), the rows times the
longest row's tokens, since the padding is computed too. Of the requests the
policy admits, in its order, those that would push the step over it wait,
in their place, for a later boundary (as with the memory budget); a request
alone always runs, whatever its tokens. 0 or None: no bound.

Preemption (a policy that ``preempts``: ``slo``): before admission, each
waiting or paused request, most urgent first, that cannot join the batch for
want of room (``max_num_seqs``, the token and memory budgets) may take the
place of running requests of strictly smaller urgency: taken least urgent
first until it fits, then those of them it fits without given back. Those are *paused*: they leave the batch, the
worker keeps their latents, noise-scheduler state and step cache (nothing
is recomputed; their LoRA slots stay theirs), and they rank among the
waiting requests until admitted again, when they go on from the step they
had reached. What paused requests hold is bounded: a preemption that would
take their state (``RequestRecord.state_bytes``, as the worker reports it
each tick) over ``max_paused_bytes`` does not happen, and no later one in
that tick either (0: no preemption). A paused request that is aborted, times
out or loses its worker is dropped there like a running one.

Deadlines also size the step (``SloPolicy.on_time``): while a request with
a deadline it can still meet would miss it at the planned batch's step time
(the step-cost model's per-step overhead plus its rows' work), the least urgent rows of less
urgent classes are paused (within the same byte bound), and no request less
urgent than it is admitted in that tick.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from diffrt.engine.record import RequestRecord, RequestStatus
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sched.base import BaseScheduler
from diffrt.engine.sched.interface import (
    BatchAdapters,
    BatchMemory,
    ExecutionResult,
    Progress,
    SchedulerOutput,
    UpdateResult,
)
from diffrt.engine.sched.policy import AdmissionPolicy
from diffrt.engine.sched.share import ShareDecider


class StepScheduler(BaseScheduler):
    def __init__(self, max_num_seqs: int = 1, policy: AdmissionPolicy | None = None, *,
                 max_wait_s: float | None = 0.0, stable_s: float | None = None,
                 key: Callable[[DiffusionRequest], tuple] | None = None,
                 max_steps_per_tick: int = 1,
                 memory: BatchMemory | None = None,
                 tokens: Callable[[DiffusionRequest], tuple[int, int]] | None = None,
                 token_budget: int | None = None, padded: bool = False,
                 adapters: BatchAdapters | None = None, max_paused_bytes: int = 0,
                 share: ShareDecider | None = None):
        super().__init__(max_num_seqs, policy, max_wait_s=max_wait_s, stable_s=stable_s, key=key,
                         memory=memory, adapters=adapters)
        #: a request's (rows, tokens a row) in a step; with ``token_budget``
        self._tokens = tokens
        self.token_budget = token_budget
        self.padded = padded
        if max_steps_per_tick < 1:
            raise ValueError(f"max_steps_per_tick must be >= 1, got {max_steps_per_tick}")
        self.max_steps_per_tick = max_steps_per_tick
        self.max_paused_bytes = max_paused_bytes
        #: decides whether a request of another kind shares the batch's steps
        #: (None: whenever the key allows)
        self.share = share
        self._now = 0.0
        #: running requests paused for more urgent ones, since start
        self.preemptions = 0
        self._pending_drops: list[str] = []

    def default_key(self, request: DiffusionRequest) -> tuple:
        return request.sampling_params.step_batch_key()

    @property
    def running_key(self) -> tuple | None:
        return self._running[0].key if self._running else None

    def has_work(self) -> bool:
        return super().has_work() or bool(self._pending_drops)

    @property
    def preempting(self) -> bool:
        return self.policy.preempts and self.max_paused_bytes > 0

    def schedule(self, now: float) -> SchedulerOutput | None:
        if self._in_flight:
            return None  # the previous tick has not been updated yet
        self._urgency_limit = None
        self._now = now
        victims = self._preempt(now) if self.preempting else []
        paused = {id(record) for record in self._paused}
        admitted = self._admit(self.running_key, self.max_num_seqs - len(self._running), now)
        if not self._running and self._paused:
            # nothing else could start (its adapters found no slot, say): the
            # paused requests hold theirs and go on
            admitted += self._resume(now)
        for record in victims:  # paused and not taken back in the same tick
            if record.status is RequestStatus.PAUSED:
                record.preemptions += 1
                self.preemptions += 1
        # a resumed request's state is in the worker: it is advanced, not sent again
        new = [record.request for record in admitted if id(record) not in paused]
        drops, self._pending_drops = self._pending_drops, []
        ids = [record.request_id for record in self._running]
        out = SchedulerOutput(new=new, scheduled_ids=ids, drop_ids=drops,
                              steps=self._steps_for_tick(drops))
        if out.is_empty:
            return None
        self.policy.waited([*self._waiting, *self._paused], now)  # a tick passed them by
        self._in_flight.update(ids)
        return out

    def step_tokens(self, requests: list[DiffusionRequest] | None = None) -> tuple[int, int]:
        """(rows, tokens computed) of a step of ``requests`` (default: the
        running ones), as the module counts them; (0, 0) without ``tokens``."""
        if self._tokens is None:
            return 0, 0
        if requests is None:
            requests = [record.request for record in self._running]
        return self._count([self._tokens(request) for request in requests])

    def _count(self, shapes: list[tuple[int, int]]) -> tuple[int, int]:
        rows = sum(n for n, _ in shapes)
        if self.padded:
            return rows, rows * max((t for _, t in shapes), default=0)
        return rows, sum(n * t for n, t in shapes)

    def next_admission_s(self, now: float, step_seconds: Callable[
            [Sequence[DiffusionRequest]], float | None]) -> float | None:
        """The running request with the fewest steps left frees its seat
        first, at the running batch's step time."""
        if not self._running:
            return None
        step = step_seconds([record.request for record in self._running])
        if step is None:
            return None
        return min(max(0, r.total_steps - r.step) for r in self._running) * step

    # -- preemption -----------------------------------------------------------------------
    def _preempt(self, now: float) -> list[RequestRecord]:
        """Pause running requests for more urgent waiting ones (see the
        module); the requests paused. Mirrors admission: a candidate that
        cannot be made room for blocks those after it, as it blocks them in
        ``_within_budget``; one whose adapters find no slot is not made room
        for; one of another batch key, or one the share decision keeps out of
        the batch's steps (a lower class may not slow a higher one's:
        ``sched/share.py``), pauses the batch only when it is more urgent
        than every request planned for it, and otherwise keeps the less
        urgent ones from joining (``SloPolicy.select``)."""
        if not self._running or not (self._waiting or self._paused) or self.holding:
            return []
        policy, urgency = self.policy, self.policy.urgency
        batch = list(self._running)  # the next step's rows as planned
        victims: list[RequestRecord] = []
        paused_bytes = self.paused_state_bytes()
        key = self.running_key
        for candidate in policy.ordered([*self._waiting, *self._paused], now):
            taken: list[RequestRecord]
            if self.adapters is not None and not self.adapters.could_admit(candidate):
                continue
            if candidate.key != key or not self._shares(candidate, batch, now, log=False):
                # it cannot, or should not, share the batch's steps
                if all(urgency(candidate) < urgency(r) for r in batch):
                    taken = [r for r in batch if r in self._running]
                else:
                    break  # the less urgent wait for the batch to drain
            elif self._fits(candidate, batch):
                batch.append(candidate)  # admission takes it: room enough
                continue
            else:
                needed = self._victims(candidate, batch, now)
                if needed is None:
                    break  # no room can be made: it blocks those after it
                taken = needed
            own = candidate.state_bytes if candidate.status is RequestStatus.PAUSED else 0
            cost = sum(record.state_bytes for record in taken) - own
            if paused_bytes + cost > self.max_paused_bytes:
                break  # at the bound: no more preemption this tick
            paused_bytes += cost
            victims += taken
            batch = [r for r in batch if r not in taken] + [candidate]
            if not any(r in batch for r in self._running):
                break  # the whole batch paused for it: the next batch is this one's
        kept, protected = policy.on_time(batch, now)
        if protected is not None:  # steps too slow for a deadline: the less urgent make way
            self._urgency_limit = protected
            for record in batch:
                if record in kept or record not in self._running or record in victims:
                    continue
                if paused_bytes + record.state_bytes <= self.max_paused_bytes:
                    paused_bytes += record.state_bytes
                    victims.append(record)
        for record in victims:
            self._running.remove(record)
            record.status = RequestStatus.PAUSED
            self._paused.append(record)
        return victims

    def _victims(self, candidate: RequestRecord, batch: list[RequestRecord],
                 now: float) -> list[RequestRecord] | None:
        """The running requests of ``batch`` to pause so ``candidate`` fits:
        of those strictly less urgent, least urgent first until it fits, then
        those it fits without given back; None when no such set exists."""
        urgency = self.policy.urgency
        less = [r for r in reversed(self.policy.ordered(batch, now))
                if r in self._running and urgency(r) > urgency(candidate)]
        taken: list[RequestRecord] = []
        for record in less:
            taken.append(record)
            if self._fits(candidate, [r for r in batch if r not in taken]):
                break
        else:
            return None
        for record in reversed(taken[:-1]):  # keep those it can do without, most urgent first
            if self._fits(candidate, [r for r in batch if r not in taken or r is record]):
                taken.remove(record)
        return taken

    def _resume(self, now: float) -> list[RequestRecord]:
        """Paused requests back into an empty batch: the most urgent one's
        key, within the budgets (their adapters hold their slots)."""
        ordered = self.policy.ordered(self._paused, now)
        key = ordered[0].key
        chosen = self._within_budget([r for r in ordered if r.key == key][:self.max_num_seqs])
        for record in chosen:
            self._paused.remove(record)
            record.status = RequestStatus.RUNNING
        self._running.extend(chosen)
        return chosen

    def _fits(self, record: RequestRecord, batch: list[RequestRecord]) -> bool:
        """``record`` joins ``batch`` within ``max_num_seqs`` and the token and
        memory budgets (a request alone always fits)."""
        if not batch:
            return True
        if len(batch) >= self.max_num_seqs:
            return False
        if self.token_budget and self._tokens is not None:
            shapes = [self._tokens(r.request) for r in (*batch, record)]
            if self._count(shapes)[1] > self.token_budget:
                return False
        memory = self.memory
        if memory is not None and memory.budget is not None:
            need = sum(memory.estimate(r.request) for r in (*batch, record))
            if need > memory.budget:
                return False
        return True

    def _within_budget(self, chosen: list[RequestRecord]) -> list[RequestRecord]:
        """The memory budget's prefix, then the prefix that keeps the step within
        ``token_budget`` (see the module)."""
        chosen = super()._within_budget(chosen)
        if self.share is not None and chosen:
            chosen = self._sharing(chosen)
        if not self.token_budget or self._tokens is None or not chosen:
            return chosen
        shapes = [self._tokens(record.request) for record in self._running]
        kept: list[RequestRecord] = []
        for record in chosen:
            shape = self._tokens(record.request)
            if self._count([*shapes, shape])[1] > self.token_budget and (self._running or kept):
                break
            kept.append(record)
            shapes.append(shape)
        return kept

    def _sharing(self, chosen: list[RequestRecord]) -> list[RequestRecord]:
        """Those of ``chosen`` the share decision lets into the batch
        (``sched/share.py``): one of a kind already in it always joins; one of
        another kind when sharing is predicted to pay. A refused one is
        passed at most ``max_bypass`` times, then blocks those after it."""
        share = self.share
        assert share is not None
        batch, kept, refused = list(self._running), [], []
        for record in chosen:
            if self._shares(record, batch, self._now):
                kept.append(record)
                batch.append(record)
                continue
            if record.bypassed >= share.max_bypass:
                break  # aged: it waits for the batch to drain, and so do those after it
            refused.append(record)
        if kept:
            for record in refused:
                if any(r.seq > record.seq for r in kept):
                    record.bypassed += 1
        return kept

    def _shares(self, record: RequestRecord, batch: list[RequestRecord], now: float, *,
                log: bool = True) -> bool:
        """Whether ``record`` may share the steps of ``batch`` (of its key):
        always without a share decision, into an empty batch or beside a row
        of its own kind; otherwise when the decision predicts it pays
        (``sched/share.py``, which also keeps a lower priority class from
        slowing a higher one's steps)."""
        share = self.share
        if share is None or not batch or share.same_kind(record, batch):
            return True
        return share.decide(batch, record, now, preempting=self.preempting, log=log).shared

    def _steps_for_tick(self, drops: list[str]) -> int:
        """Several steps unless worker state is to be dropped; never past the
        step that finishes the first request. Called after this tick's
        admission: whoever still waits was refused by the policy (no room, an
        incompatible key, or FIFO's head of line) and would be refused at the
        next boundary too, so only a request that arrives during the call
        waits for it — at most ``max_steps_per_tick`` steps."""
        if self.max_steps_per_tick == 1 or drops or not self._running:
            return 1
        left = min(record.total_steps - record.step for record in self._running)
        return max(1, min(self.max_steps_per_tick, left))

    def _update_request(self, record: RequestRecord, result: ExecutionResult, produced: bool,
                        update: UpdateResult) -> None:
        """A step (or several) of ``record``: its progress, and its end when it
        finished, failed or was aborted."""
        rid = record.request_id
        self._in_flight.discard(rid)
        failed = result.failed_all if result.failed_all is not None else result.errors.get(rid)
        before = record.step
        if produced:
            record.step = record.total_steps
        elif rid in result.steps:
            record.step = result.steps[rid]
        if rid in result.state_bytes:
            record.state_bytes = result.state_bytes[rid]
        if record.abort_requested or failed is not None:
            self._running.remove(record)
            if not record.abort_requested:  # a failure: the steps it finished in this call
                update.progress += _steps(record, before + 1, min(record.step, record.total_steps - 1))
            # After a failed call the worker may still hold its state.
            if not produced and (record.abort_requested or result.failed_all is not None):
                self._pending_drops.append(rid)
            status = RequestStatus.ABORTED if record.abort_requested else RequestStatus.FAILED
            update.finished.append(self._finish(record, status, error=None if record.abort_requested
                                                else failed))
        elif produced:
            self._running.remove(record)
            # the steps a multi-step tick ran before the last one
            update.progress += _steps(record, before + 1, record.total_steps - 1)
            update.finished.append(self._finish(record, RequestStatus.FINISHED, has_output=True))
        else:  # one progress item per step, also when a tick ran several
            update.progress += _steps(record, min(before + 1, record.step), record.step)

    def _on_running_aborted(self, record: RequestRecord) -> None:
        self._pending_drops.append(record.request_id)

    def fail_all(self, error: str):
        self._pending_drops.clear()
        return super().fail_all(error)

    def fail_running(self, error: str):
        self._pending_drops.clear()  # the states to drop died with the worker
        return super().fail_running(error)


def _steps(record: RequestRecord, first: int, last: int) -> list[Progress]:
    """Progress items of ``record`` for steps ``first`` .. ``last`` (none when
    ``first > last``): one per step, also when a call ran several."""
    return [Progress(record.request_id, step, record.total_steps) for step in range(first, last + 1)]
