"""What ``DiffusionEngine.stats()`` reports, and the recorder behind it.

A server exports these (Prometheus, a dashboard) without reaching into the
engine's internals: gauges are read when asked, counters and histograms are
cumulative since the engine started, so any scraper can take differences.
Histograms keep per-bucket counts against fixed upper bounds, the shape
Prometheus histograms have; the recorder depends on no metrics library.

The recorder has a lock of its own, held only to update or copy numbers: it
may be called with the output processor's lock held and never calls out.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

from diffrt.engine.outputs import DiffusionOutput, TextEncoderStats

#: Upper bounds (seconds) for request-scale durations: latency, queue and output waits.
REQUEST_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
                     120.0, 300.0, 600.0)
#: Upper bounds (seconds) for one denoise step.
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

#: Upper bounds for the rows of one step (STEP_BATCH).
STEP_ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
#: Upper bounds for the tokens one step computes (STEP_BATCH).
STEP_TOKENS_BUCKETS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)

#: How a finished request ended (the ``outcome`` of ``requests_total``).
OUTCOMES = ("success", "error", "aborted", "timeout")


@dataclass(frozen=True)
class Histogram:
    """Counts per bucket: ``counts[i]`` observations <= ``bounds[i]`` and above
    the previous bound; the last count is above every bound (+Inf)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot; see the module docstring."""

    #: accepted, not yet admitted to a batch.
    requests_waiting: int
    #: in a batch (REQUEST_BATCH: the forward in flight; STEP_BATCH: the running set).
    requests_running: int
    #: outcome (``OUTCOMES``) -> requests that ended so.
    requests_total: dict[str, int]
    #: arrival to final output.
    request_latency_s: Histogram
    #: arrival to first batch.
    queue_wait_s: Histogram
    #: one denoise step of a batch (REQUEST_BATCH: the forward over its steps).
    step_time_s: Histogram
    #: compute done to output in host memory.
    output_wait_s: Histogram
    text_encoding: TextEncoderStats = field(default_factory=TextEncoderStats)
    #: bytes of finished outputs waiting for their consumers.
    pending_output_bytes: int = 0
    healthy: bool = True
    #: times fresh workers replaced dead or hung ones (``restart_workers``)
    worker_restarts: int = 0
    #: how long the execute call in flight has gone without progress (0: none in flight)
    seconds_without_progress: float = 0.0
    #: ``DiffusionEngine.stall()``: why the engine counts as stalled, else None
    stall: str | None = None
    #: STEP_BATCH: the rows of each denoise step (outputs, twice with CFG), and
    #: the tokens it computed (each row's text + image tokens, summed; every
    #: row the longest row's when rows of several sizes are padded into one
    #: call, ``mixed_rows="padded"``)
    step_batch_rows: Histogram = field(default_factory=lambda: _Buckets(STEP_ROWS_BUCKETS).snapshot())
    step_batch_tokens: Histogram = field(
        default_factory=lambda: _Buckets(STEP_TOKENS_BUCKETS).snapshot())
    #: LoRA adapters (``engine.lora``): registered now, device slots in use of
    #: ``lora_slots`` (``max_loras``), adapters copied into a slot since start
    #: and the copies that evicted another, and requests accepted per adapter
    #: name (registered names only: operators choose them, so bounded)
    loras_registered: int = 0
    lora_slots_used: int = 0
    lora_slots: int = 0
    lora_loads_total: int = 0
    lora_evictions_total: int = 0
    lora_requests_total: dict[str, int] = field(default_factory=dict)
    #: step caches (``engine.cache``): denoise steps of finished requests per
    #: policy and outcome ("computed", "reused"), and the requests that asked
    #: for a cache but ran uncached, per reason (``CacheMetrics.uncached_reason``)
    cache_steps_total: dict[tuple[str, str], int] = field(default_factory=dict)
    cache_uncached_total: dict[str, int] = field(default_factory=dict)
    #: deadlines (``SamplingParams.deadline_s``): finished requests with one per
    #: (priority class, outcome "met" | "missed" | "refused"); a failed or
    #: timed-out one missed it, an aborted one is not counted, "refused": by
    #: ``refuse_unmeetable`` at submission. The class is the priority as
    #: a string (at most 21 values)
    requests_deadline_total: dict[tuple[str, str], int] = field(default_factory=dict)
    #: ``slo`` preemption: running requests paused since start, paused now,
    #: and the step state they keep in the workers
    preemptions_total: int = 0
    requests_paused: int = 0
    paused_state_bytes: int = 0
    #: the workers sleep (``DiffusionEngine.sleep``): requests wait for ``wake``
    sleeping: bool = False
    #: the step-cost model (``run_time.py``): its online coefficients by term
    #: (seconds a call, a token, ...; empty before a fit), the idle ones the
    #: limits are judged by, and its recent |measured - predicted| / measured
    #: of a tick (median, p90; None before a prediction)
    step_cost: dict[str, float] = field(default_factory=dict)
    step_cost_idle: dict[str, float] = field(default_factory=dict)
    step_cost_error: tuple[float, float] | None = None
    #: share/split decisions (``sched/share.py``): requests of another kind
    #: that joined a step, and those kept apart
    steps_shared_total: int = 0
    steps_split_total: int = 0


def classify(output: DiffusionOutput) -> str:
    if output.ok:
        return "success"
    if output.aborted:
        return "aborted"
    return "timeout" if output.timed_out else "error"


class _Buckets:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> Histogram:
        return Histogram(self.bounds, tuple(self.counts), self.sum)


class StatsRecorder:
    """Cumulative counters and histograms; fed by the output processor."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Back to zero (after the engine's warm-up request)."""
        with self._lock:
            self._zero()

    def _zero(self) -> None:
        self._outcomes = dict.fromkeys(OUTCOMES, 0)
        self._latency = _Buckets(REQUEST_BUCKETS_S)
        self._queue = _Buckets(REQUEST_BUCKETS_S)
        self._step = _Buckets(STEP_BUCKETS_S)
        self._cache_steps: dict[tuple[str, str], int] = {}
        self._cache_uncached: dict[str, int] = {}
        self._deadlines: dict[tuple[str, str], int] = {}
        self._output_wait = _Buckets(REQUEST_BUCKETS_S)
        self._text = TextEncoderStats()
        self._rows = _Buckets(STEP_ROWS_BUCKETS)
        self._tokens = _Buckets(STEP_TOKENS_BUCKETS)

    def on_tick(self, step_seconds: float | None, text: TextEncoderStats | None,
                steps: int = 1, *, rows: int = 0, tokens: int = 0) -> None:
        """A tick that ran ``steps`` denoise steps of ``step_seconds`` each, of
        ``rows`` rows and ``tokens`` tokens (one observation per step: a
        multi-step tick counts as its steps; rows 0: not counted)."""
        with self._lock:
            if step_seconds is not None:
                for _ in range(max(1, steps)):
                    self._step.observe(step_seconds)
                    if rows:
                        self._rows.observe(rows)
                        self._tokens.observe(tokens)
            if text is not None:
                self._text = self._text + text

    def on_final(self, output: DiffusionOutput) -> None:
        m = output.metrics
        with self._lock:
            self._outcomes[classify(output)] += 1
            if m.finished_time is not None:
                self._latency.observe(max(0.0, m.finished_time - m.arrival_time))
            if m.queue_wait is not None:
                self._queue.observe(m.queue_wait)
            if m.output_wait is not None:
                self._output_wait.observe(m.output_wait)
            if m.cache is not None:
                for outcome, n in (("computed", m.cache.steps_computed),
                                   ("reused", m.cache.steps_reused)):
                    key = (m.cache.policy, outcome)
                    self._cache_steps[key] = self._cache_steps.get(key, 0) + n
                if m.cache.uncached_reason is not None:
                    reason = m.cache.uncached_reason
                    self._cache_uncached[reason] = self._cache_uncached.get(reason, 0) + 1
            if m.deadline_met is not None:
                key = (str(m.priority), "met" if m.deadline_met else "missed")
                self._deadlines[key] = self._deadlines.get(key, 0) + 1

    def on_refused(self, priority: int) -> None:
        """A request of ``priority`` was refused as unable to meet its
        deadline (``refuse_unmeetable``): outcome "refused"."""
        key = (str(priority), "refused")
        with self._lock:
            self._deadlines[key] = self._deadlines.get(key, 0) + 1

    def snapshot(self, *, waiting: int, running: int, pending_output_bytes: int,
                 healthy: bool, worker_restarts: int = 0,
                 seconds_without_progress: float = 0.0,
                 stall: str | None = None, loras: dict[str, int] | None = None,
                 lora_requests: dict[str, int] | None = None,
                 paused: tuple[int, int, int] = (0, 0, 0)) -> EngineStats:
        """``paused``: (requests paused now, their state bytes, preemptions since start)."""
        lora = loras or {}
        with self._lock:
            return EngineStats(
                requests_waiting=waiting, requests_running=running,
                requests_total=dict(self._outcomes),
                request_latency_s=self._latency.snapshot(),
                queue_wait_s=self._queue.snapshot(),
                step_time_s=self._step.snapshot(),
                output_wait_s=self._output_wait.snapshot(),
                text_encoding=self._text,
                pending_output_bytes=pending_output_bytes, healthy=healthy,
                worker_restarts=worker_restarts,
                seconds_without_progress=seconds_without_progress, stall=stall,
                step_batch_rows=self._rows.snapshot(), step_batch_tokens=self._tokens.snapshot(),
                loras_registered=lora.get("registered", 0), lora_slots_used=lora.get("slots_used", 0),
                lora_slots=lora.get("slots", 0), lora_loads_total=lora.get("loads", 0),
                lora_evictions_total=lora.get("evictions", 0),
                lora_requests_total=dict(lora_requests or {}),
                cache_steps_total=dict(self._cache_steps),
                cache_uncached_total=dict(self._cache_uncached),
                requests_deadline_total=dict(self._deadlines),
                requests_paused=paused[0], paused_state_bytes=paused[1],
                preemptions_total=paused[2])
