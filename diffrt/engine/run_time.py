"""How long a request will hold this engine: the estimate ``max_request_seconds`` refuses by.

One denoise step of a batch costs, in seconds,

    o + k * sum over the batch's rows of W(T),    W(T) = T * (1 + T / (6 * width))

where a *row* is one output's pass through the transformer (a request has
``num_outputs_per_prompt`` rows, twice that when CFG runs) and ``T`` is a row's
tokens: its image tokens (height x width / size_multiple^2, the packed latent
patches) plus the model's text tokens. ``W`` counts one transformer layer's
work in units of one token through its linear layers: those (Q, K, V, the
output projection and a 4x MLP, 24 x width^2 flops a token) grow with T;
attention's two products (4 x width x T flops a token) grow with T^2 — the
quadratic term that makes a 512 x 512 request many times the cost of four
256 x 256 ones. ``width`` is the transformer's attention width
(``ModelSpec.transformer_width``; 0 when a spec does not say: linear only).

``o`` (per-step overhead: launches, the Python around the forward) and ``k``
(seconds per unit) are fitted by least squares over the measured ticks
(``observe``, from the engine core: every tick's seconds per step and the
requests it ran), grouped by their work in bins a quarter of an octave wide:
each bin keeps its latest ticks and counts once in the fit, with their
median, so a thousand-step request of one size does not crowd out what the
other sizes measured, a tick that also encoded prompts or decoded images
does not pull its size's time up, and a bin follows its size's time as load
changes. The
engine calibrates at warm-up with a short request
larger than the warm-up's, so the estimate exists before the first client
request; traffic then refines it. While the measured ticks all have about the
same work, the two terms cannot be told apart and the fit goes through the
origin (o = 0): for requests larger than any measured, that over-estimates
(the overhead is charged per unit), so a refusal errs on the side of the
engine's other clients. A request's estimate is

    steps x (o + k x rows x W(T))

— its run alone; batched with others it shares its steps, so this is an upper
bound on the engine time it takes from them.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Iterable

from diffrt.engine.model_spec import ModelSpec
from diffrt.engine.request import DiffusionRequest

#: bins per octave of work: ticks within a bin are one size to the fit
BINS_PER_OCTAVE = 4
#: the latest ticks a bin keeps (their median is its size's seconds per step)
TICKS_PER_BIN = 15
#: the spread of work (coefficient of variation) below which o and k are not
#: told apart and the fit goes through the origin
MIN_SPREAD = 0.25


class RunTimeModel:
    """Estimates a request's seconds on this engine from measured ticks (see the module).

    ``observe`` runs on the engine core's thread, ``estimate`` on submitting
    threads; the bins are refitted under a lock when next read."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        #: bin -> its latest ticks, (units, seconds per step)
        self._bins: dict[int, deque[tuple[float, float]]] = {}
        self._lock = threading.Lock()
        self._fit: tuple[float, float] | None = None  # (o, k)
        self._stale = False

    # -- the work of a request -----------------------------------------------------------
    def units(self, request: DiffusionRequest) -> float:
        """The work one denoise step of ``request`` does, in W units."""
        tokens = float(self.spec.row_tokens(request))
        width = self.spec.transformer_width
        per_row = tokens * (1 + tokens / (6 * width)) if width else tokens
        return self.spec.rows(request) * per_row

    # -- measuring -------------------------------------------------------------------------
    def observe(self, requests: Iterable[DiffusionRequest], step_seconds: float) -> None:
        """One tick ran ``requests`` together at ``step_seconds`` a denoise step."""
        units = sum(self.units(r) for r in requests)
        if units <= 0 or not step_seconds > 0:
            return
        key = round(math.log2(units) * BINS_PER_OCTAVE)
        with self._lock:
            self._bins.setdefault(key, deque(maxlen=TICKS_PER_BIN)).append((units, step_seconds))
            self._stale = True  # refitted when next read: ticks outnumber submissions

    def reset(self) -> None:
        """Forget every measurement (the cold warm-up request says little)."""
        with self._lock:
            self._bins.clear()
            self._fit, self._stale = None, False

    @property
    def calibrated(self) -> bool:
        return self.coefficients is not None

    @property
    def coefficients(self) -> tuple[float, float] | None:
        """(seconds of overhead per step, seconds per W unit), None before a measurement."""
        with self._lock:
            if self._stale:
                self._fit = _fit([(statistics.fmean(u for u, _ in ticks),
                                   statistics.median(s for _, s in ticks))
                                  for ticks in self._bins.values()])
                self._stale = False
            return self._fit

    # -- estimating ------------------------------------------------------------------------
    def estimate(self, request: DiffusionRequest) -> float | None:
        """Seconds ``request`` (defaults filled in) would run alone; None before
        the first measured tick."""
        fit = self.coefficients
        if fit is None:
            return None
        overhead, per_unit = fit
        steps = request.sampling_params.denoise_steps()
        return steps * (overhead + per_unit * self.units(request))


def _fit(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares of seconds = o + k x units with o, k >= 0; through the
    origin when the work barely varies (or the free fit says o or k < 0)."""
    n = len(samples)
    su = sum(u for u, _ in samples)
    ss = sum(s for _, s in samples)
    suu = sum(u * u for u, _ in samples)
    sus = sum(u * s for u, s in samples)
    mean_u, mean_s = su / n, ss / n
    var_u = suu / n - mean_u * mean_u
    if n >= 2 and var_u > (MIN_SPREAD * mean_u) ** 2:
        k = (sus / n - mean_u * mean_s) / var_u
        o = mean_s - k * mean_u
        if k > 0 and o >= 0:
            return o, k
    return 0.0, sus / suu
