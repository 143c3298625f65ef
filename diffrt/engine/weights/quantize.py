"""Lower-precision weights for a loaded component, through the libraries that
own them: diffusers' layerwise casting and torchao's ``quantize_``.

* ``fp8-storage``: parameters stored as float8 e4m3 and cast to the compute
  dtype around each layer's forward (diffusers' layerwise casting; norms,
  positional and patch embeddings and the patch projections stay as loaded,
  diffusers' default skip list, with a model's ``_keep_in_fp32_modules``).
  Every device runs it: the cast is an ordinary copy.
* ``int8``: weight-only int8 with one scale per output channel (torchao's
  ``Int8WeightOnlyConfig``) on every ``nn.Linear``. On CPU it dequantises
  per call: it saves memory, not time.
* ``fp8``: float8 weights *and* activations with per-row scales, matmuls in
  float8 (torchao's ``Float8DynamicActivationFloat8WeightConfig``): only a
  device with float8 matmuls (``Platform.fp8_matmul_supported``) runs it.

Quantised linears stay ``nn.Linear`` modules (their weight a tensor
subclass), so forward hooks — the per-row LoRA terms of ``lora.row_lora`` —
apply on top of the quantised base as they do on a float one.
"""

from __future__ import annotations

import typing
from types import ModuleType

import torch

from diffrt.engine.settings import QuantizationMethod

METHODS: tuple[str, ...] = typing.get_args(QuantizationMethod)
#: the methods that need torchao
TORCHAO_METHODS = ("int8", "fp8")


TORCHAO_MISSING = "int8 and fp8 weights need torchao: pip install 'diffrt[quant]'"


class QuantizationUnavailable(RuntimeError):
    """The method's library is not installed."""


def _torchao() -> ModuleType:
    try:
        import torchao.quantization as quantization
    except ImportError as exc:
        raise QuantizationUnavailable(TORCHAO_MISSING) from exc
    return quantization


def torchao_available() -> bool:
    try:
        _torchao()
    except QuantizationUnavailable:
        return False
    return True


def _is_linear(module: torch.nn.Module, _fqn: str) -> bool:
    return isinstance(module, torch.nn.Linear)


def quantize_module(module: torch.nn.Module, method: str, compute_dtype: torch.dtype) -> None:
    """Convert ``module``'s weights in place to ``method`` ("none": nothing)."""
    if method == "none":
        return
    if method == "fp8-storage":
        enable = getattr(module, "enable_layerwise_casting", None)
        if callable(enable):  # a diffusers model: its own skip list joins the default
            enable(storage_dtype=torch.float8_e4m3fn, compute_dtype=compute_dtype)
            return
        from diffusers.hooks import apply_layerwise_casting
        from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

        # a transformers model's fp32 modules stay as loaded: T5 casts its
        # input to ``wo.weight``'s dtype before that layer's hook could run
        keep = tuple(getattr(module, "_keep_in_fp32_modules", None) or ())
        apply_layerwise_casting(module, storage_dtype=torch.float8_e4m3fn,
                                compute_dtype=compute_dtype,
                                skip_modules_pattern=(*DEFAULT_SKIP_MODULES_PATTERN, *keep))
        return
    quantization = _torchao()
    if method == "int8":
        config = quantization.Int8WeightOnlyConfig()
    elif method == "fp8":
        config = quantization.Float8DynamicActivationFloat8WeightConfig(
            granularity=quantization.PerRow())
    else:
        raise ValueError(f"quantization must be one of {METHODS}, got {method!r}")
    quantization.quantize_(module, config, filter_fn=_is_linear)


__all__ = ["METHODS", "TORCHAO_METHODS", "TORCHAO_MISSING", "QuantizationUnavailable", "quantize_module",
           "torchao_available"]
