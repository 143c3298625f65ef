"""How much memory a request's forward takes at its peak: what the batch budget counts.

A batch's activations, not its weights, are what grow with the requests in
it: one 512x512 n=10 request on diffrt-shapes took a CPU worker about 3 GB
above its warm size, and eight of them batched would take the host. The
schedulers keep the requests of one batch within ``max_batch_memory_bytes``
of these estimates (a request that does not fit waits for the next tick).

A request's peak, in bytes, is estimated from its shape as

    rows x T x width x LINEAR_WIDTHS x b  +  outputs x H x W x DECODE_BYTES_PER_PIXEL x b / 4

the transformer's activations (``rows``: its outputs, twice that with CFG;
``T`` a row's tokens, image patches plus text tokens; ``width`` the
attention width; ``LINEAR_WIDTHS`` the widths a token's activations span
within one block: Q, K, V, the attention output and the MLP's 4x
intermediate, with a margin) plus the VAE decode's, which grow with the
output's pixels and dominate on large images (its full-resolution
feature maps). ``b`` is the bytes of one value of the worker's dtype (4 for
float32, 2 for half types). Attention's ``T^2`` term is left out: the
attention kernels diffrt runs (torch's SDPA, flash or memory-efficient,
also on CPU) do not materialise the score matrix.

The constants are from measurements on this CPU (float32): tiny-flux, 512 x
512 n=4, 1 step, took a worker 713 MiB above its warm size (this formula:
1.0 GiB); diffrt-shapes 512 x 512 n=10 with its true CFG took 2,966 MB
(issue 27; this formula: 4.4 GiB). The formula errs high, on the side of
the host.

``MemoryModel`` calibrates it per engine: every execute's reply carries the
most the worker held during it above its warm baseline
(``engine/memory_trim.py``), and the model keeps the ratio of that peak to
the formula's sum over the requests that ran, for the executes large enough
to tell (a formula of ``MIN_CALIBRATION_BYTES`` or more: below that, a
peak is a few MiB of scratch that says nothing of the scale). An estimate is
the formula times the *scale*: the largest of the latest
``CALIBRATION_WINDOW`` ratios, with ``CALIBRATION_MARGIN``, within
``SCALE_BOUNDS`` — the largest, because the budget exists to keep the host
alive, so the estimate follows the worst batch measured, not the typical
one. Until a large enough execute is measured the scale is 1: the formula.

The budget (``max_batch_memory_bytes``, when not set) is a share of the
memory the workers report free once they are loaded and warm
(``Platform.free_memory_bytes``, with the reply that takes the baseline):
``DEFAULT_HOST_SHARE`` of the host's available memory on CPU (other
processes share the host), ``DEFAULT_DEVICE_SHARE`` of a device's free
memory. Until that reply a CPU engine uses the share of the host's available
memory read when it starts; a device engine has no budget.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from diffrt.engine.model_spec import ModelSpec
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import filled

if TYPE_CHECKING:
    from diffrt.platforms.interface import Platform

logger = logging.getLogger(__name__)

#: the widths of activations one token holds inside a transformer block
LINEAR_WIDTHS = 12
#: the bytes per output pixel the VAE decode holds at its peak, in float32
DECODE_BYTES_PER_PIXEL = 1024
#: the share of the host's available memory a CPU engine's batch may take by default
DEFAULT_HOST_SHARE = 0.5
#: the share of a device's free memory (after loading) a batch may take by default
DEFAULT_DEVICE_SHARE = 0.8
#: executes whose formula is below this do not calibrate the scale
MIN_CALIBRATION_BYTES = 64 << 20
#: the latest measured ratios the scale follows
CALIBRATION_WINDOW = 32
#: the scale is the largest measured ratio times this
CALIBRATION_MARGIN = 1.1
#: the scale never leaves these bounds, whatever was measured
SCALE_BOUNDS = (0.25, 4.0)


def value_bytes(dtype: str, platform: Platform) -> int:
    """Bytes of one activation value in the workers: ``dtype="auto"`` is float32
    on CPU and a half type elsewhere (``pipeline_runner.resolve_dtype``)."""
    if dtype == "float32" or (dtype == "auto" and platform.device_type == "cpu"):
        return 4
    return 2


def default_batch_memory_budget(platform: Platform) -> int | None:
    """``max_batch_memory_bytes=None``: on CPU ``DEFAULT_HOST_SHARE`` of the
    host's available memory (``MemAvailable``, read when the engine starts,
    after the workers loaded the model); None (no budget) on a device, whose
    free memory only the workers can read, and off Linux."""
    if platform.device_type != "cpu":
        return None
    from diffrt.platforms.cpu import available_host_bytes

    available = available_host_bytes()
    return None if available is None else int(available * DEFAULT_HOST_SHARE)


def peak_activation_bytes(spec: ModelSpec, request: DiffusionRequest,
                          value_bytes: int = 4) -> int:
    """The estimated peak activation memory of ``request`` run alone, in bytes
    (see the module); ``value_bytes``: 4 for float32 weights, 2 for half types."""
    params = request.sampling_params
    height, width = filled(params.height), filled(params.width)
    outputs = filled(params.num_outputs_per_prompt)
    transformer = (spec.rows(request) * spec.row_tokens(request)
                   * max(1, spec.transformer_width) * LINEAR_WIDTHS * value_bytes)
    decode = (outputs * spec.output_frames(params) * height * width * DECODE_BYTES_PER_PIXEL
              * value_bytes // 4)
    return int(transformer + decode)


class MemoryModel:
    """A request's estimated peak memory on this engine, and the batch budget
    it is held to (see the module). The schedulers read ``estimate`` and
    ``budget``; the engine core feeds ``observe`` with each execute's reply,
    on the core's thread."""

    def __init__(self, spec: ModelSpec, value_bytes: int = 4, *, budget: int | None = None,
                 explicit: bool = False, share: float = DEFAULT_HOST_SHARE):
        self.spec = spec
        self.value_bytes = value_bytes
        #: bytes of estimated peak memory one batch may take (None: no bound)
        self.budget = budget
        self._explicit = explicit  # max_batch_memory_bytes was set: never replaced
        self.share = share
        self._ratios: deque[float] = deque(maxlen=CALIBRATION_WINDOW)
        #: the formula's calibration: 1 until a large enough execute is measured
        self.scale = 1.0

    def formula(self, request: DiffusionRequest) -> int:
        return peak_activation_bytes(self.spec, request, self.value_bytes)

    def estimate(self, request: DiffusionRequest) -> int:
        """Bytes ``request`` is expected to take at its peak, alone."""
        return int(self.formula(request) * self.scale)

    def observe(self, requests: Iterable[DiffusionRequest], peak_bytes: int | None,
                free_bytes: int | None = None) -> None:
        """One execute ran ``requests`` and the worker held at most
        ``peak_bytes`` above its warm baseline (None: not measured);
        ``free_bytes``: the memory free when it took its baseline."""
        if free_bytes is not None and not self._explicit:
            self.budget = int(free_bytes * self.share)
            logger.info("batch memory budget %d MiB: %.0f%% of the %d MiB free to the warm workers",
                        self.budget >> 20, 100 * self.share, free_bytes >> 20)
        if peak_bytes is None:
            return
        formula = sum(self.formula(r) for r in requests)
        if formula < MIN_CALIBRATION_BYTES:
            return
        self._ratios.append(peak_bytes / formula)
        low, high = SCALE_BOUNDS
        self.scale = min(high, max(low, max(self._ratios) * CALIBRATION_MARGIN))
