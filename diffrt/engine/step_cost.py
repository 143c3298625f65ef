"""A step-cost model: the predicted seconds of a tick from the rows it runs.

A tick runs ``steps`` denoise steps of the same rows (``max_steps_per_tick``)
and costs, in seconds,

    steps x (c_call x calls + c_token x tokens + c_attention x attention
             + c_adapter x adapter_tokens)
    + c_tick + c_encode x new requests + c_decode x finished rows' tokens

where, for one step, ``calls`` is the transformer calls its arrangement
makes (``by_size``: one per row size; ``padded`` and ``packed``: one),
``tokens`` the tokens the calls compute (each row's, or with ``padded`` every
row the longest row's), ``attention`` the sum of each computed row's tokens
squared (attention's quadratic term; ``packed`` attends within each row),
``adapter_tokens`` the tokens of rows with LoRA adapters; ``c_tick`` is a
call's fixed cost around the steps (the round trip to the workers, copies),
``c_encode`` a new request's prompt encoding and ``c_decode`` a finished row's
decode, per token. CFG's branches are rows (``ModelSpec.rows``).

The coefficients are fitted online from every tick by weighted least squares
with all coefficients non-negative:

- *decaying*: each tick's evidence is multiplied by ``DECAY`` per later tick,
  so the fit follows the machine (about ``1 / (1 - DECAY)`` ticks of memory);
- *robust*: a tick whose time is far from the prediction (a page fault, a
  garbage collection, another process) counts less the further it is off:
  past ``HUBER`` (relative) its weight is ``(HUBER / error)^2``. Online,
  the prediction is the fit before the tick; from a few ticks (a
  calibration's) that fit is no yardstick (noise set the slope near 0, and
  the large size's ticks that would correct it looked like outliers), so
  ``refit`` weighs the kept ticks again against the fit of them all,
  round after round (iteratively reweighted least squares);
- *seeded*: the fit is drawn towards a prior (the warm-up calibration, or
  the persisted model of an earlier run: ``cost_store``) with the weight of
  ``PRIOR_TICKS`` ticks, so a coefficient that traffic does not tell apart
  (every tick of one size says nothing of ``c_call``) keeps the calibrated
  value instead of wandering with noise;
- *split by flops*: given ``attention_per_token`` (attention's flops per
  token pair over a layer's flops per token, ``1 / (6 width)``), the fit is
  drawn, with the weight of ``SPLIT_TICKS`` ticks, towards ``c_attention =
  attention_per_token x c_token``. Over the few sizes a calibration
  measures, the linear and the quadratic term are nearly collinear: unheld,
  noise alone split the slope between them (one run put it all on tokens,
  the next all on attention, which differ tenfold at four times the
  calibrated tokens). Where the ticks do tell them apart, they outweigh the
  pull.

The model also keeps its recent relative prediction error (``error``), what
``/metrics``, ``diffrt env --check`` and the bench trace show.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

#: the coefficients' names, in feature order
FEATURES = ("call", "token", "attention", "adapter_token", "tick", "encode", "decode")
#: per-tick multiplier of earlier evidence
DECAY = 0.995
#: relative residual past which a tick's weight falls as 1 / residual
HUBER = 0.25
#: ticks kept as measured, for ``refit`` (a calibration's, and more)
KEPT_TICKS = 64
#: ``refit``'s reweighting rounds
REFIT_ROUNDS = 6
#: the prior's weight, in ticks
PRIOR_TICKS = 3.0
#: the flops ratio's pull on the attention term, in ticks (``attention_per_token``)
SPLIT_TICKS = 1.0
#: ticks whose prediction error is kept for ``error``
ERROR_WINDOW = 200
#: ridge on the scaled normal equations (numerical only)
_RIDGE = 1e-9


@dataclass(frozen=True)
class StepShape:
    """One denoise step's work, as the module counts it."""

    calls: float = 0.0
    tokens: float = 0.0
    attention: float = 0.0
    adapter_tokens: float = 0.0


@dataclass(frozen=True)
class Row:
    """A request's rows in a step: how many, their tokens each, whether LoRA."""

    count: int
    tokens: int
    adapters: bool = False


def step_shape(rows: Sequence[Row], arrangement: str) -> StepShape:
    """The work of one step of ``rows`` arranged as ``arrangement``
    (``by_size``, ``padded``, ``packed``)."""
    rows = [r for r in rows if r.count > 0]
    if not rows:
        return StepShape()
    adapter_tokens = float(sum(r.count * r.tokens for r in rows if r.adapters))
    if arrangement == "padded":
        n, longest = sum(r.count for r in rows), max(r.tokens for r in rows)
        return StepShape(1.0, float(n * longest), float(n * longest * longest), adapter_tokens)
    calls = float(len({r.tokens for r in rows})) if arrangement == "by_size" else 1.0
    return StepShape(calls, float(sum(r.count * r.tokens for r in rows)),
                     float(sum(r.count * r.tokens * r.tokens for r in rows)), adapter_tokens)


def tick_features(shape: StepShape, steps: int, new: int = 0,
                  decoded_tokens: float = 0.0) -> np.ndarray:
    """The feature vector of a tick (``FEATURES`` order)."""
    return np.array([steps * shape.calls, steps * shape.tokens, steps * shape.attention,
                     steps * shape.adapter_tokens, 1.0, float(new), float(decoded_tokens)])


class StepCostModel:
    """Tick seconds from tick features, fitted online (see the module).

    ``observe`` runs on the engine core's thread, ``predict`` anywhere; the
    fit is recomputed under a lock when next read after new evidence."""

    def __init__(self, prior: Mapping[str, float] | None = None, *, decay: float = DECAY,
                 attention_per_token: float | None = None):
        n = len(FEATURES)
        self.decay = decay
        #: the flops ratio the attention term is drawn to (see the module); None: free
        self.attention_per_token = attention_per_token
        self._lock = threading.Lock()
        self._xtx = np.zeros((n, n))
        self._xty = np.zeros(n)
        self._scale = np.ones(n)  # each feature's typical size, for conditioning
        self._seen = np.zeros(n, dtype=bool)
        self._prior: np.ndarray | None = None
        self._fit: np.ndarray | None = None
        self._stale = False
        self.ticks = 0
        self._weight = 0.0  # the evidence's decayed weight, in ticks
        self._errors: deque[float] = deque(maxlen=ERROR_WINDOW)
        self._kept: deque[tuple[np.ndarray, float]] = deque(maxlen=KEPT_TICKS)
        if prior is not None:
            self.set_prior(prior)

    # -- the prior ------------------------------------------------------------------------
    def set_prior(self, coefficients: Mapping[str, float]) -> None:
        """Draw the fit towards ``coefficients`` (missing names: 0)."""
        with self._lock:
            self._prior = np.array([max(0.0, float(coefficients.get(f, 0.0)))
                                    for f in FEATURES])
            self._stale = True

    @property
    def has_prior(self) -> bool:
        return self._prior is not None

    # -- measuring ------------------------------------------------------------------------
    def observe(self, features: np.ndarray, seconds: float) -> float | None:
        """One tick of ``features`` took ``seconds``; returns what the model
        predicted for it beforehand (None before any evidence)."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return None
        predicted = self.predict(features)
        weight = 1.0
        if predicted is not None and predicted > 0:
            error = (seconds - predicted) / predicted
            self._errors.append(abs(seconds - predicted) / seconds)
            if abs(error) > HUBER:  # a redescending weight: far outliers barely count
                weight = (HUBER / abs(error)) ** 2
        with self._lock:
            present = features > 0
            grow = present & ~self._seen
            self._scale[grow] = features[grow]  # a feature's scale: its first size
            self._seen |= present
            self._kept.append((features.copy(), seconds))
            self._xtx *= self.decay
            self._xty *= self.decay
            self._xtx += weight * np.outer(features, features)
            self._xty += weight * features * seconds
            self._weight = self._weight * self.decay + weight
            self.ticks += 1
            self._stale = True
        return predicted

    def reset(self) -> None:
        """Forget the evidence (the prior stays)."""
        with self._lock:
            self._xtx[:] = 0.0
            self._xty[:] = 0.0
            self._seen[:] = False
            self._fit, self._stale, self.ticks = None, self._prior is not None, 0
            self._weight = 0.0
            self._errors.clear()
            self._kept.clear()

    def refit(self) -> None:
        """Weigh the kept ticks again by their distance from the fit of them
        all (``HUBER``, past the median distance where that is larger: a
        loaded machine's usual noise is no outlier), ``REFIT_ROUNDS`` times,
        and make that the evidence (the engine calls it when its
        calibration has run: see the module)."""
        with self._lock:
            kept = list(self._kept)
        if len(kept) < 2:
            return
        x = np.array([f for f, _ in kept])
        y = np.array([t for _, t in kept])
        weights = np.ones(len(kept))
        for _ in range(REFIT_ROUNDS):
            with self._lock:
                self._xtx = (x * weights[:, None]).T @ x
                self._xty = (x * weights[:, None]).T @ y
                self._weight = float(weights.sum())
                fit = self._solve()
            if fit is None:
                return
            predicted = np.maximum(x @ fit, 1e-12)
            error = np.abs(y - predicted) / predicted
            bound = max(HUBER, 1.5 * float(np.median(error)))
            weights = np.where(error <= bound, 1.0, (bound / np.maximum(error, 1e-12)) ** 2)
        with self._lock:
            self._stale = True

    # -- the fit --------------------------------------------------------------------------
    @property
    def coefficients(self) -> dict[str, float] | None:
        """The fitted coefficients by name; None before any evidence or prior."""
        fit = self._current()
        return None if fit is None else dict(zip(FEATURES, (float(c) for c in fit), strict=True))

    def predict(self, features: np.ndarray) -> float | None:
        """Predicted seconds of a tick of ``features``; None before any fit."""
        fit = self._current()
        return None if fit is None else float(fit @ features)

    def error(self) -> tuple[float, float] | None:
        """(median, p90) of the recent ticks' |measured - predicted| / measured."""
        errors = sorted(self._errors)
        if not errors:
            return None
        return statistics.median(errors), errors[min(len(errors) - 1, int(0.9 * len(errors)))]

    def _current(self) -> np.ndarray | None:
        with self._lock:
            if self._stale:
                self._fit = self._solve()
                self._stale = False
            return self._fit

    def _solve(self) -> np.ndarray | None:
        """Non-negative least squares on the decayed normal equations plus the
        prior (active set: a coefficient that would go negative is held at 0)."""
        if self.ticks == 0:
            return self._prior
        scale = self._scale
        a = self._xtx / np.outer(scale, scale)  # in units of each feature's scale
        b = self._xty / scale
        a = a + _RIDGE * np.trace(a) * np.eye(len(FEATURES))
        if self._prior is not None:
            # the prior as PRIOR_TICKS ticks of each feature at its scale
            strength = PRIOR_TICKS * np.diag(np.diag(a) / max(self._weight, 1e-9) + _RIDGE)
            a = a + strength
            b = b + strength @ (self._prior * scale)
        a = a + self._split_pull(a)
        free = np.ones(len(FEATURES), dtype=bool)
        unknown = ~self._seen if self._prior is None else np.zeros_like(free)
        free &= ~unknown  # a feature never measured has no coefficient to fit
        solution = np.zeros(len(FEATURES))
        while free.any():
            idx = np.flatnonzero(free)
            sub = np.linalg.lstsq(a[np.ix_(idx, idx)], b[idx], rcond=None)[0]
            if (sub >= 0).all():
                solution[idx] = sub
                break
            free[idx[np.argmin(sub)]] = False
        return solution / scale

    def _split_pull(self, a: np.ndarray) -> np.ndarray:
        """The normal equations' term drawing ``c_attention`` towards
        ``attention_per_token x c_token`` with ``SPLIT_TICKS`` ticks of the
        attention feature's weight (in the scaled units of ``_solve``)."""
        ratio = self.attention_per_token
        tok, att = FEATURES.index("token"), FEATURES.index("attention")
        if not ratio or not (self._seen[tok] and self._seen[att]) or self._weight <= 0:
            return np.zeros_like(a)
        # (c_att - ratio c_tok) in scaled coordinates x = c x scale, per unit of c_att's scale
        u = np.zeros(len(FEATURES))
        u[att], u[tok] = 1.0, -ratio * self._scale[att] / self._scale[tok]
        return SPLIT_TICKS * a[att, att] / self._weight * np.outer(u, u)

    # -- persistence ----------------------------------------------------------------------
    def state(self) -> dict[str, object]:
        """What ``cost_store`` writes: the coefficients and the evidence's size."""
        return {"coefficients": self.coefficients, "ticks": self.ticks, "error": self.error()}


def reference_seconds(coefficients: Mapping[str, float], shapes: Sequence[StepShape]) -> float:
    """Seconds of a step of each of ``shapes`` by ``coefficients`` (one step a
    tick), summed: how two models compare on the work that matters."""
    return sum(float(np.array([coefficients.get(f, 0.0) for f in FEATURES])
                     @ tick_features(shape, 1)) for shape in shapes)


__all__ = ["DECAY", "FEATURES", "HUBER", "KEPT_TICKS", "PRIOR_TICKS", "SPLIT_TICKS", "Row", "StepCostModel",
           "StepShape", "reference_seconds", "step_shape", "tick_features"]
