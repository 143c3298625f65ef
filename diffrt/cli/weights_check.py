"""The ``weights`` part of ``diffrt env --check``: what the weight settings
cost and save on this device, side by side in one run.

Per setting — as loaded, ``int8``, ``fp8`` (only where the device has float8
matmuls), ``offload="layerwise"`` and ``offload="model"`` (only where the
host is not the device) — one engine on tiny-flux runs the same requests:
requests per second and the ratio to as-loaded, the weights on the device
at their peak (``WeightBytes.on_device``), the device's peak memory where
the platform reports it, and the PSNR of each image against as-loaded (the
offloads must give the same bits: ``identical``). A setting the platform
refuses is entered as ``{"skipped": reason}`` with the refusal's line. The
tiny model's figures show the paths run on the device and what they cost
per call; the memory a real checkpoint saves follows from the bytes.
"""

from __future__ import annotations

import math
import time
from typing import Any

#: label -> the EngineConfig settings it adds
SETTINGS: dict[str, dict[str, Any]] = {
    "none": {},
    "int8": {"quantization": "int8"},
    "fp8": {"quantization": "fp8", "dtype": "bfloat16"},
    "offload_layerwise": {"offload": "layerwise"},
    "offload_model": {"offload": "model"},
}


def _psnr(a: Any, b: Any) -> float:
    """Of two uint8 images (``output_type="pt"``: (N, H, W, C) uint8)."""
    mse = float(((a.float() - b.float()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def weights_part(*, requests: int, size: int, steps: int,
                 timeout_s: float) -> dict[str, Any]:
    """See the module; each engine runs its worker in this process (the
    settings are what is compared, not the executors)."""
    from diffrt.engine import DiffusionEngine, EngineConfig, EngineConfigError
    from diffrt.engine.request import DiffusionRequest
    from diffrt.engine.sampling import SamplingParams
    from diffrt.platforms import current_platform as platform

    batch = [DiffusionRequest(f"check {i}", sampling_params=SamplingParams(
        height=size, width=size, num_inference_steps=steps, seed=i, output_type="pt"))
        for i in range(requests)]
    result: dict[str, Any] = {"model": "tiny-flux", "requests": requests, "size": size}
    baseline: list[Any] | None = None
    base_rate = None
    for label, extra in SETTINGS.items():
        try:
            config = EngineConfig(model="tiny-flux", executor_backend="inproc",
                                  warmup=False, **extra)  # warmed by one request below
            config.executor_config(platform=platform)  # the refusals that need the platform
        except EngineConfigError as exc:
            result[label] = {"skipped": str(exc)}
            continue
        platform.reset_peak_memory()
        with DiffusionEngine.make_engine(config) as engine:
            engine.generate(batch[0], timeout=timeout_s)  # first-call costs, untimed
            start = time.perf_counter()
            outputs = engine.generate(batch, timeout=timeout_s)
            elapsed = time.perf_counter() - start
            failed = [o.error for o in outputs if not o.ok]
            if failed:
                raise RuntimeError(f"{label}: {failed[0]}")
            weights = engine.weight_bytes
        images = [o.output for o in outputs]
        rate = requests / elapsed
        entry: dict[str, Any] = {
            "requests_per_s": round(rate, 3),
            "weights_on_device_bytes": weights.on_device if weights is not None else None,
            "peak_device_bytes": platform.peak_memory_bytes()}
        if baseline is None:
            baseline, base_rate = images, rate
        else:
            entry["x_none"] = round(rate / base_rate, 3) if base_rate else None
            values = [_psnr(a, b) for a, b in zip(images, baseline, strict=True)]
            entry["psnr_min_db"] = None if math.isinf(min(values)) else round(min(values), 1)
            if label.startswith("offload"):
                entry["identical"] = all(math.isinf(v) for v in values)
        result[label] = entry
    result["ok"] = all(result[label].get("identical", True) for label in SETTINGS
                       if isinstance(result.get(label), dict))
    return result


__all__ = ["SETTINGS", "weights_part"]
