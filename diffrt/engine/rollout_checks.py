"""What a model and an engine refuse of a rollout request at submission
(docs/rollouts.md): the rollout fields (``sampler``, ``return_log_probs``,
``return_trajectory``, ``seeds``) on a model whose denoise loop serves them
(``ModelSpec.rollouts``), for text-to-image, without a step cache, and a
trajectory that fits the output arena."""

from __future__ import annotations

from diffrt.engine.model_spec import ModelSpec
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import InvalidRequestError, filled


def check_rollout(spec: ModelSpec, request: DiffusionRequest) -> None:
    """Raise InvalidRequestError naming the field ``spec``'s model cannot
    serve of ``request``'s rollout (its defaults filled in)."""
    params = request.sampling_params
    asked = [name for name, on in (("sampler", params.sampler != "default"),
                                   ("return_trajectory", params.return_trajectory),
                                   ("seeds", params.seeds is not None)) if on]
    if not asked:
        return
    if not spec.rollouts:
        raise InvalidRequestError(asked[0], f"{spec.name}'s denoise loop serves no rollouts "
                                            "(the flow-matching image families do)")
    if request.images:
        raise InvalidRequestError(asked[0], "applies to text-to-image requests (no input images)")
    cached = params.cache not in (None, "off") or (params.cache is None and spec.cache.default)
    if cached and (params.sampler != "default" or params.return_trajectory):
        raise InvalidRequestError("cache", (
            'a rollout runs every step: set cache="off" (a reused step has no transition of '
            "its own to log)"))
    _check_trajectory_bytes(spec, request)


def _check_trajectory_bytes(spec: ModelSpec, request: DiffusionRequest) -> None:
    """A trajectory travels with the images through the output arena, sized
    for the model's largest output (``ModelSpec.largest_output_bytes``): one
    that would not fit there is refused, naming the field."""
    params = request.sampling_params
    if not params.return_trajectory:
        return
    steps = params.denoise_steps() + 1
    need = (spec.output_bytes_per_pixel * filled(params.height) * filled(params.width)
            * params.num_outputs_per_prompt * steps)
    room = spec.largest_output_bytes()
    if need > room:
        raise InvalidRequestError("return_trajectory", (
            f"{steps} latents of {params.num_outputs_per_prompt} output(s) at "
            f"{params.height}x{params.width} take about {need / 2**20:.0f} MiB, more than one "
            f"output may ({room / 2**20:.0f} MiB): fewer steps, outputs or pixels"))


__all__ = ["check_rollout"]
