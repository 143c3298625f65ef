"""The parts a ``ModelSpec`` is built from: a model's sampling defaults, the
step caches and splits over ranks it supports, the weight methods, and the
check of a Ulysses degree against its heads. Plain msgspec data, as the spec
is; ``model_spec`` re-exports every name (families import them from there).
"""

from __future__ import annotations

import typing

import msgspec

from diffrt.engine.parallel.degrees import ParallelConfigError
from diffrt.engine.settings import QuantizationMethod


class SamplingDefaults(msgspec.Struct, frozen=True, kw_only=True):
    """What a request's sampling fields left at None become."""

    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    true_cfg_scale: float = 1.0
    #: image-to-image and inpainting (diffusers' default for both)
    strength: float = 0.6
    #: a video model's clip (None: an image model, which refuses both fields)
    num_frames: int | None = None
    fps: float | None = None


class CacheSupport(msgspec.Struct, frozen=True, kw_only=True):
    """The step caches a model serves (``engine.cache``) and its calibration."""

    #: the policies its pipeline can run ("first-block", "teacache"); empty: none
    policies: tuple[str, ...] = ()
    #: the policy a request that leaves ``cache`` at None gets (None: off)
    default: str | None = None
    #: policy -> the threshold calibrated for this checkpoint (a policy not
    #: named takes ``policies.DEFAULT_THRESHOLDS``')
    thresholds: dict[str, float] = {}
    #: TeaCache's rescaling polynomial fitted for this checkpoint, highest
    #: power first (empty: the distance as it is, uncalibrated)
    teacache_rescale: tuple[float, ...] = ()


#: the VAEs whose decoder splits in bands of rows (``engine.parallel.vae``,
#: ``engine.parallel.video_vae``)
BANDED_VAES = ("AutoencoderKL", "AutoencoderKLWan")


class ParallelSupport(msgspec.Struct, frozen=True, kw_only=True):
    """How a model may be split over ranks (``check_parallel``)."""

    #: any split at all (a pipeline without one runs on one rank only)
    multi_rank: bool = False
    #: the transformer's image tokens split over ranks (Ulysses, ring)
    sequence: bool = False
    #: the transformer's attention heads (Ulysses needs its degree to divide them)
    attention_heads: int | None = None
    #: the VAE's diffusers class (the banded parallel decode needs an AutoencoderKL)
    vae_class: str = "AutoencoderKL"


#: every lower-precision weight method (what a family that applies them all declares)
WEIGHT_METHODS: tuple[str, ...] = tuple(m for m in typing.get_args(QuantizationMethod)
                                        if m != "none")


def check_heads(heads: int | None, ulysses: int) -> None:
    """Ulysses exchanges heads for tokens: its degree must divide the heads."""
    if ulysses > 1 and heads and heads % ulysses:
        raise ParallelConfigError("ulysses_degree", (
            f"{ulysses} does not divide the transformer's {heads} attention heads "
            "(ring_degree takes any count)"))


__all__ = ["BANDED_VAES", "WEIGHT_METHODS", "CacheSupport", "ParallelSupport", "SamplingDefaults",
           "check_heads"]
