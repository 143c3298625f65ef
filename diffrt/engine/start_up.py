"""The engine's start-up requests: the warm-up, then the calibration.

The warm-up request (cold: it loads kernels, allocates buffers) runs first
and is no measure of a warm tick; the calibration requests that follow are
the step-cost model's first measurements (``run_time.py``): they set its
idle speed unless a faster one was persisted by an earlier run
(``cost_store``), and, in STEP_BATCH, the default token budget is derived
from that idle model (``token_budget.py``), so it is the same at every
start. A model that only edits (Qwen-Image-Edit draws nothing from text
alone) gets a plain picture as input.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Protocol

from diffrt.engine.config import EngineConfig
from diffrt.engine.errors import EngineWarmupError
from diffrt.engine.model_spec import ModelSpec
from diffrt.engine.output_processor import OutputProcessor
from diffrt.engine.outputs import DiffusionOutput
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.run_time import ATTENTION_TOKENS_PER_WIDTH, RunTimeModel
from diffrt.engine.sampling import OutputType, SamplingParams
from diffrt.engine.sched import Scheduler, StepScheduler
from diffrt.engine.token_budget import derived_token_budget

logger = logging.getLogger(__name__)

#: the second calibration request has at least this many times the first's work
CALIBRATION_WORK_RATIO = 2.0
#: the third has this many times the second's: its work outweighs a step's
#: fixed cost, so the slope is measured over a wide span, not within noise
LARGEST_WORK_RATIO = 4.0
#: worker calls each calibration request runs: the fit has seven terms, and
#: one slow tick (another process) among few would set one of them alone
CALIBRATION_TICKS = 2
#: ... and the third, undecoded and so cheap, this many: the slope rests on
#: its steps, and a machine busy with other processes times few steps badly
LARGEST_TICKS = 4
#: times the calibration requests run at most: again while the fit of their
#: ticks prices no step's size (a stall on a busy machine can set the slope
#: to 0 however the ticks are weighed; a model whose steps do not grow with
#: size, as the tests' toy, runs them twice)
CALIBRATION_ROUNDS = 2


class StartingEngine(Protocol):
    """What the start-up requests need of the engine (``DiffusionEngine``)."""

    config: EngineConfig
    spec: ModelSpec
    run_time: RunTimeModel
    output_processor: OutputProcessor

    @property
    def scheduler(self) -> Scheduler: ...

    def generate(self, requests: DiffusionRequest, *,
                 timeout: float | None = None) -> DiffusionOutput: ...

    def save_costs(self) -> None: ...


def warmup_request(spec: ModelSpec) -> DiffusionRequest:
    """A one-step request of about 64 px: loads kernels, allocates buffers."""
    size = spec.warmup_size()
    return DiffusionRequest(
        prompt="warm-up", request_id=f"warmup-{uuid.uuid4().hex[:8]}",
        images=start_up_images(spec, size),
        sampling_params=SamplingParams(height=size, width=size, num_inference_steps=1,
                                       seed=0, guidance_scale=1.0))


def start_up_images(spec: ModelSpec, side: int) -> list:
    """A start-up request's input: none, or a plain picture for a model
    that only edits (Qwen-Image-Edit draws nothing from text alone)."""
    if "text-to-image" in spec.tasks:
        return []
    from PIL import Image

    return [Image.new("RGB", (side, side), (128, 128, 128))]


def calibration_requests(spec: ModelSpec, run_time: RunTimeModel,
                         max_steps_per_tick: int, round_: int = 0) -> list[DiffusionRequest]:
    """The step-cost model's first measurements, on warm kernels, at three
    sizes: a step's fixed cost, its per-token cost and attention's quadratic
    term are three unknowns, and two sizes tell only one slope from the
    fixed cost (the split between the linear and the quadratic term would be
    noise's, and a fit that puts none on attention prices a large request
    far too low). The sizes: the warm-up's side; the smallest side (within
    the model's limits) with ``CALIBRATION_WORK_RATIO`` times its work (text
    tokens dominate a small image's row, so twice the side is not always
    enough); and the smallest side with ``LARGEST_WORK_RATIO`` times the
    second's work whose row has ``ATTENTION_TOKENS_PER_WIDTH`` x the
    attention width in tokens, where attention is a third of a step's flops
    (or the largest side). Each runs ``CALIBRATION_TICKS`` worker calls' worth
    of steps (so prompt encoding and the decode weigh on few of them), with a
    prompt of its own (the prompt cache would spare the others their
    encoding). The third is not decoded (``latent``): the first two measure
    the decode, and a large clip's decode would cost the start more than its
    steps; a model that serves no latents (LTX-2's sound) calibrates on the
    first two (its third, decoded, took 30 of a 36 s start on tiny-ltx2)."""
    multiple = spec.size_multiple
    largest = spec.max_size // multiple * multiple

    def request(i: int, side: int, output_type: OutputType = "np",
                ticks: int = CALIBRATION_TICKS) -> DiffusionRequest:
        return DiffusionRequest(
            prompt=f"calibration {round_}.{i}", request_id=f"calibrate-{uuid.uuid4().hex[:8]}",
            images=start_up_images(spec, side),
            sampling_params=SamplingParams(
                height=side, width=side, seed=0, guidance_scale=1.0, output_type=output_type,
                num_inference_steps=ticks * max_steps_per_tick))

    def work(side: int) -> float:
        return run_time.units(spec.with_defaults(request(0, side)))

    def next_side(side: int, enough: Callable[[int], bool]) -> int:
        """The smallest side past ``side`` that is ``enough`` (or the largest)."""
        while side + multiple <= largest:
            side += multiple
            if enough(side):
                break
        return side

    first = spec.warmup_size()
    second = next_side(first, lambda s: work(s) >= CALIBRATION_WORK_RATIO * work(first))
    attention_tokens = ATTENTION_TOKENS_PER_WIDTH * spec.transformer_width
    third = next_side(second, lambda s: (
        work(s) >= LARGEST_WORK_RATIO * work(second)
        and spec.row_tokens(spec.with_defaults(request(0, s))) >= attention_tokens))
    requests = [request(0, first)]
    if second > first:
        requests.append(request(1, second))
    if third > second and not spec.sound:
        requests.append(request(2, third, "latent", LARGEST_TICKS))
    return requests


def _run(engine: StartingEngine, request: DiffusionRequest) -> None:
    timeout = engine.config.model_config.warmup_timeout_s
    try:
        out = engine.generate(request, timeout=timeout)
    except TimeoutError:
        raise EngineWarmupError(
            f"warm-up did not finish within warmup_timeout_s={timeout}") from None
    if not out.ok:
        raise EngineWarmupError(f"warm-up request failed: {out.error}")


def warm_up(engine: StartingEngine) -> None:
    """The warm-up request, then the calibration requests whose measured
    steps are the run-time estimate's first (and, in STEP_BATCH without
    ``max_num_batched_tokens``, what the token budget is derived from)."""
    start = time.monotonic()
    spec, run_time = engine.spec, engine.run_time
    _run(engine, warmup_request(spec))
    run_time.reset()  # a cold tick is no measure of a warm one
    for round_ in range(CALIBRATION_ROUNDS):
        for request in calibration_requests(spec, run_time,
                                            engine.config.scheduling.max_steps_per_tick, round_):
            _run(engine, request)
        if run_time.refit():
            break
        logger.info("the calibration's steps did not tell sizes apart (a stalled tick on a "
                    "busy machine?)%s", "" if round_ + 1 == CALIBRATION_ROUNDS
                    else ": measuring them again")
    engine.output_processor.stats.reset()  # stats() describes served requests only
    run_time.finish_calibration()
    engine.save_costs()
    scheduler = engine.scheduler
    scheduler.forget_run_times()  # a cold one-step request sizes no window
    if (isinstance(scheduler, StepScheduler)
            and engine.config.scheduling.max_num_batched_tokens is None):
        scheduler.token_budget = derived_token_budget(
            run_time.idle, run_time.calibration_shapes()[0], run_time.steps_per_tick)
        logger.info("max_num_batched_tokens: %s (derived from the %s step-cost model)",
                    scheduler.token_budget or "no bound",
                    "persisted" if run_time.restored else "calibrated")
    logger.info("warm-up done in %.2f s", time.monotonic() - start)


__all__ = ["CALIBRATION_ROUNDS", "CALIBRATION_TICKS", "CALIBRATION_WORK_RATIO", "LARGEST_TICKS",
           "LARGEST_WORK_RATIO", "calibration_requests", "start_up_images", "warm_up",
           "warmup_request"]
