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
(issue 27; this formula: 4.4 GiB). The estimate errs high, which errs on the side of the
host: a batch is split sooner than it needs to be, never later. It is not
calibrated per engine (the run-time estimate is; peaks are not reported
by the workers yet).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from diffrt.engine.model_spec import ModelSpec
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import filled

if TYPE_CHECKING:
    from diffrt.platforms.interface import Platform

#: the widths of activations one token holds inside a transformer block
LINEAR_WIDTHS = 12
#: the bytes per output pixel the VAE decode holds at its peak, in float32
DECODE_BYTES_PER_PIXEL = 1024
#: the share of the host's available memory a CPU engine's batch may take by default
DEFAULT_HOST_SHARE = 0.5


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
    decode = outputs * height * width * DECODE_BYTES_PER_PIXEL * value_bytes // 4
    return int(transformer + decode)
