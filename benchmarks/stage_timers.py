"""Seconds spent in the transformer, the VAE and the text encoders, wherever they run.

Imported by ``bench_mixed_traffic.py`` in its own process (the diffusers
systems) and, as a ``plugin_modules`` entry, in diffrt's worker processes. On
import it wraps, at class level, the calls each stage is made of:

- transformer: diffusers' ``FluxTransformer2DModel.forward`` and
  ``SD3Transformer2DModel.forward``, diffrt's ``transformer_forward`` of both
  families (whose mixed-size path runs the transformer's modules without its
  ``forward``) and ``FlowMatchPipeline.run_transformer``, which every diffrt
  transformer call goes through (a call with step-cached rows runs the
  blocks without ``transformer_forward``, ``engine.cache.forward``); only the
  outermost of them is counted;
- vae: ``AutoencoderKL.decode`` and ``.encode`` (image-to-image and
  inpainting inputs);
- text: ``CLIPTextModel.forward``, ``CLIPTextModelWithProjection.forward``
  (SD3) and ``T5EncoderModel.forward``.

On CPU a call's wall time is its compute (nothing is asynchronous). The
totals are written as JSON to ``$DIFFRT_STAGE_TIMERS`` after every call (a
few microseconds on tmpfs), so the parent reads them whenever the process
ends. Benchmark code only: nothing in diffrt imports it.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from typing import Any

TOTALS = {"transformer": 0.0, "vae": 0.0, "text": 0.0}
_LOCK = threading.Lock()
_DEPTH = threading.local()


def _write() -> None:
    path = os.environ.get("DIFFRT_STAGE_TIMERS")
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(TOTALS, f)
        os.replace(path + ".tmp", path)


def _timed(stage: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_DEPTH, stage, 0)
        setattr(_DEPTH, stage, depth + 1)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(_DEPTH, stage, depth)
            if depth == 0:  # the outermost call of its stage
                with _LOCK:
                    TOTALS[stage] += time.perf_counter() - start
                    _write()

    wrapper.__stage_timed__ = True  # type: ignore[attr-defined]
    return wrapper


def _wrap(cls: Any, name: str, stage: str) -> None:
    fn = getattr(cls, name)
    if not getattr(fn, "__stage_timed__", False):
        setattr(cls, name, _timed(stage, fn))


def install() -> None:
    from diffusers import AutoencoderKL, FluxTransformer2DModel, SD3Transformer2DModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel

    from diffrt.engine.pipelines.flow_match import FlowMatchPipeline
    from diffrt.engine.pipelines.flux.pipeline import FluxPipeline
    from diffrt.engine.pipelines.sd3.pipeline import SD3Pipeline

    _wrap(FluxTransformer2DModel, "forward", "transformer")
    _wrap(SD3Transformer2DModel, "forward", "transformer")
    _wrap(FluxPipeline, "transformer_forward", "transformer")
    _wrap(SD3Pipeline, "transformer_forward", "transformer")
    _wrap(FlowMatchPipeline, "run_transformer", "transformer")
    _wrap(AutoencoderKL, "decode", "vae")
    _wrap(AutoencoderKL, "encode", "vae")
    _wrap(CLIPTextModel, "forward", "text")
    _wrap(CLIPTextModelWithProjection, "forward", "text")
    _wrap(T5EncoderModel, "forward", "text")


def read(path: str) -> dict[str, float]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return dict.fromkeys(TOTALS, 0.0)


install()
