"""How long a request will hold this engine, from the step-cost model.

The engine's ``RunTimeModel`` prices requests and steps with two
``step_cost`` models of the same form:

- ``online``: fitted from every tick (``observe_tick``, from the engine core:
  the requests it ran, its steps, its seconds, the prompts it encoded and the
  outputs it decoded), seeded by the persisted model of an earlier run
  (``cost_store``) and by the warm-up's calibration. It follows the
  machine's momentary speed: the ``slo`` policy's remaining work and step
  sizing, admission estimates and the bench trace's predictions use it.
- ``idle``: the calibrated speed, fixed for the run: the fastest of the
  warm-up's calibration and the persisted idle model (compared on the
  calibration's own steps, ``reference_seconds``). Cost limits
  (``max_request_seconds``, ``estimate``) and the derived token budget are
  judged by it, so a request admissible on an idle machine is not refused
  on a loaded one, and the budget is the same at every start (momentary
  load is backpressure's to answer, not the limit's).

A request's estimate is its run alone::

    steps x step(rows) + ceil(steps / steps a tick) x c_tick + c_encode
    + c_decode x its outputs' tokens

— batched with others it shares its steps, so this bounds the engine time it
takes from them. ``units`` (a step's work in tokens through a layer,
attention's quadratic term counted by flops: ``W(T) = T (1 + T / (6
width))``) sizes the calibration requests before any fit.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping, Sequence

from diffrt.engine.model_spec import ModelSpec
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import filled
from diffrt.engine.step_cost import (
    FEATURES,
    Row,
    StepCostModel,
    StepShape,
    reference_seconds,
    step_shape,
    tick_features,
)

#: the largest calibration request's row has this many tokens per unit of
#: attention width: attention then does a third of the step's flops (``units``)
ATTENTION_TOKENS_PER_WIDTH = 3


class RunTimeModel:
    """Seconds of steps and requests on this engine (see the module)."""

    def __init__(self, spec: ModelSpec, *, arrangement: str = "by_size",
                 steps_per_tick: int = 1, persisted: Mapping[str, Mapping[str, float]] | None = None):
        self.spec = spec
        #: how a step's rows of several sizes reach the transformer (``mixed_rows`` resolved)
        self.arrangement = arrangement
        self.steps_per_tick = max(1, steps_per_tick)
        persisted = persisted or {}
        #: fitted from every tick; seeded by the last run's online fit
        width = spec.transformer_width
        self.online = StepCostModel(prior=persisted.get("latest") or persisted.get("idle"),
                                    attention_per_token=1 / (6 * width) if width else None)
        #: the calibrated idle speed (None until calibrated; see the module)
        self.idle: dict[str, float] | None = (dict(persisted["idle"]) if "idle" in persisted
                                              else None)
        #: whether ``idle`` came from an earlier run
        self.restored = self.idle is not None
        self._lock = threading.Lock()

    # -- the work of a request -----------------------------------------------------------
    def units(self, request: DiffusionRequest) -> float:
        """The flops-weighted work one denoise step of ``request`` does, in
        tokens through a layer (sizes the calibration before any fit)."""
        tokens = float(self.spec.row_tokens(request))
        width = self.spec.transformer_width
        per_row = tokens * (1 + tokens / (6 * width)) if width else tokens
        return self.spec.rows(request) * per_row

    def row(self, request: DiffusionRequest) -> Row:
        return Row(self.spec.rows(request), self.spec.row_tokens(request),
                   bool(request.sampling_params.loras))

    def shape(self, requests: Iterable[DiffusionRequest], arrangement: str | None = None
              ) -> StepShape:
        """One step of ``requests`` together (in this engine's arrangement
        unless another is named)."""
        return step_shape([self.row(r) for r in requests], arrangement or self.arrangement)

    def decoded_tokens(self, request: DiffusionRequest) -> float:
        """The image tokens its outputs decode (one per output, no CFG branch;
        none for latents, which are not decoded)."""
        if request.sampling_params.output_type == "latent":
            return 0.0
        return float(filled(request.sampling_params.num_outputs_per_prompt)
                     * (self.spec.row_tokens(request) - self.spec.text_tokens))

    # -- measuring -------------------------------------------------------------------------
    def observe_tick(self, requests: Sequence[DiffusionRequest], steps: int, seconds: float,
                     new: int = 0, decoded_tokens: float = 0.0) -> float | None:
        """One tick ran ``steps`` steps of ``requests`` in ``seconds``, encoding
        ``new`` prompts and decoding outputs of ``decoded_tokens``; returns
        the online model's prediction for it (None before any fit)."""
        if not requests or steps < 1:
            return None
        features = tick_features(self.shape(requests), steps, new, decoded_tokens)
        return self.online.observe(features, seconds)

    def observe(self, requests: Sequence[DiffusionRequest], step_seconds: float) -> None:
        """A tick of one step of ``requests`` took ``step_seconds``."""
        self.observe_tick(list(requests), 1, step_seconds)

    def reset(self) -> None:
        """Forget the ticks measured (the cold warm-up request says little)."""
        self.online.reset()

    def finish_calibration(self) -> None:
        """The warm-up's calibration ran (and was refitted: ``refit``): the
        idle model becomes the faster of the online fit and the persisted idle
        model, on the calibration's steps (``calibration_shapes``)."""
        fit = self.online.coefficients
        if fit is None:
            return
        with self._lock:
            if self.idle is None or (reference_seconds(fit, self.calibration_shapes())
                                     < reference_seconds(self.idle, self.calibration_shapes())):
                self.idle = fit
                self.restored = False

    def refit(self) -> bool:
        """Refit the online model robustly from its kept ticks (the
        calibration's: ``StepCostModel.refit``); whether it now prices work,
        i.e. makes a larger step cost more (a per-token or an attention
        term): one that puts all of a step on its fixed cost would price any
        size like the smallest."""
        self.online.refit()
        fit = self.online.coefficients
        return fit is not None and (fit["token"] > 0 or fit["attention"] > 0)

    def reference(self, *, idle: bool = True) -> float | None:
        """Seconds of the calibration's steps (``calibration_shapes``) by the
        idle (or online) model: one number to compare speeds by."""
        fit = self.idle if idle else self.online.coefficients
        return None if fit is None else reference_seconds(fit, self.calibration_shapes())

    def calibration_shapes(self) -> list[StepShape]:
        """The steps two models are compared on: one row of the model's
        warm-up side, one of twice its side and, where the attention width
        is known, one of ``ATTENTION_TOKENS_PER_WIDTH`` x the width in tokens
        (the calibration's largest: attention's term counts)."""
        side = self.spec.warmup_size()
        tokens = [(s // self.spec.size_multiple) ** 2 + self.spec.text_tokens
                  for s in (side, 2 * side)]
        if self.spec.transformer_width:
            tokens.append(max(tokens[-1], ATTENTION_TOKENS_PER_WIDTH * self.spec.transformer_width))
        return [step_shape([Row(1, t)], self.arrangement) for t in tokens]

    # -- the fit ------------------------------------------------------------------------------
    @property
    def calibrated(self) -> bool:
        return self.idle is not None or self.online.coefficients is not None

    @property
    def coefficients(self) -> dict[str, float] | None:
        """The online fit's coefficients by name (``step_cost.FEATURES``)."""
        return self.online.coefficients

    @property
    def step_overhead(self) -> float | None:
        """Seconds a step costs whatever its rows (a call and its share of a
        tick's fixed cost), online; None before any fit."""
        fit = self.online.coefficients
        return None if fit is None else fit["call"] + fit["tick"] / self.steps_per_tick

    @property
    def tick_seconds(self) -> float | None:
        """A step's share of a tick's fixed cost (online); None before any fit."""
        fit = self.online.coefficients
        return None if fit is None else fit["tick"] / self.steps_per_tick

    def work_seconds(self, request: DiffusionRequest) -> float:
        """Seconds of a step that ``request``'s rows add (online; 0 before any fit)."""
        fit = self.online.coefficients
        if fit is None:
            return 0.0
        return _apply(fit, self.shape([request])) - fit["call"]

    def step_seconds(self, requests: Sequence[DiffusionRequest], *, arrangement: str | None = None,
                     idle: bool = False) -> float | None:
        """Predicted seconds of one step of ``requests`` (without the tick's
        fixed cost); None before any fit."""
        fit = self.idle if idle else self.online.coefficients
        if fit is None:
            return None
        return _apply(fit, self.shape(requests, arrangement))

    def loaded_step_seconds(self, requests: Sequence[DiffusionRequest]) -> float | None:
        """A step of ``requests`` with its share of a tick's fixed cost, at
        the momentary speed (the online fit): what a queue's wait is
        predicted from (Retry-After); None before any fit."""
        step, tick = self.step_seconds(requests), self.tick_seconds
        return None if step is None else step + (tick or 0.0)

    # -- estimating ------------------------------------------------------------------------
    def estimate(self, request: DiffusionRequest, *, idle: bool = True) -> float | None:
        """Seconds ``request`` (defaults filled in) would run alone, at the
        calibrated idle speed (``idle=False``: the momentary one); None
        before any calibration."""
        fit = self.idle if idle and self.idle is not None else self.online.coefficients
        if fit is None:
            return None
        steps = request.sampling_params.denoise_steps()
        ticks = math.ceil(steps / self.steps_per_tick)
        return (steps * _apply(fit, self.shape([request])) + ticks * fit["tick"]
                + fit["encode"] + fit["decode"] * self.decoded_tokens(request))

    def models(self) -> dict[str, dict[str, float] | None]:
        """What ``cost_store`` persists."""
        return {"idle": self.idle, "latest": self.online.coefficients}


def _apply(fit: Mapping[str, float], shape: StepShape) -> float:
    """One step's seconds by ``fit`` (no tick, encode or decode cost)."""
    return (fit["call"] * shape.calls + fit["token"] * shape.tokens
            + fit["attention"] * shape.attention + fit["adapter_token"] * shape.adapter_tokens)


__all__ = ["ATTENTION_TOKENS_PER_WIDTH", "FEATURES", "RunTimeModel"]
