"""What the engine checks and settles for a request at submission (refusing
what it cannot carry).

A request is accepted only if it can be carried end to end: every field's type
and range, the model's own limits (its ``ModelSpec``), the engine's run-time limit
(``max_request_seconds``, on ``run_time``'s estimate),
and the message a worker will receive (encoded here, per request, so one
request that cannot be encoded never reaches a tick its neighbours share).
Refusals raise ``InvalidRequestError`` naming the field. The accepted request
is the engine's own copy, with the model's sampling defaults filled in and its
seed drawn when none was given.
"""

from __future__ import annotations

import msgspec

from diffrt.engine.config import EngineConfig
from diffrt.engine.errors import EngineClosedError, InputsFullError
from diffrt.engine.input_images import release, store, to_arrays
from diffrt.engine.model_spec import ModelSpec
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.rollout_checks import check_rollout
from diffrt.engine.run_time import RunTimeModel
from diffrt.engine.sampling import InvalidRequestError, filled, random_seed
from diffrt.runtime.input_arena import InputArena, InputArenaClosedError, InputArenaFullError


def check(request: object, spec: ModelSpec, config: EngineConfig,
          run_time: RunTimeModel | None = None) -> DiffusionRequest:
    """``accept``'s refusals alone (``InvalidRequestError``), storing nothing:
    ``request`` with the model's defaults filled in. A server asks this
    before it creates what outlives the request (a video job), so what the
    engine refuses is answered at once rather than as a failed job."""
    if not isinstance(request, DiffusionRequest):
        raise InvalidRequestError(
            "request", f"must be a DiffusionRequest, got {type(request).__name__}")
    request.validate()
    request = spec.with_defaults(request)  # the model's, for fields left at None
    if config.model_config.batch_invariant and not request.sampling_params.deterministic:
        request = msgspec.structs.replace(request, sampling_params=msgspec.structs.replace(
            request.sampling_params, deterministic=True))
    spec.check(request)
    check_rollout(spec, request)
    params = request.sampling_params
    if params.cache not in (None, "off") and _splits_rows(config):
        raise InvalidRequestError("cache", (
            "step caches run where one rank holds a request's rows whole: not with "
            "cfg_parallel_size, ulysses_degree or ring_degree above 1 (each rank would decide "
            "on its own share of the rows)"))
    engine_limit = config.limits.request_timeout_s
    if params.deadline_s is not None and engine_limit is not None and params.deadline_s > engine_limit:
        raise InvalidRequestError("deadline_s", (
            f"{params.deadline_s:g} s is past this engine's request_timeout_s "
            f"({engine_limit:g} s), which would end it first"))
    if params.partial_images and not config.scheduling.step_execution:
        raise InvalidRequestError(
            "partial_images", "previews need step boundaries: run the engine with "
            "step_execution=True (REQUEST_BATCH runs a request as one forward)")
    limit = config.limits.max_request_seconds
    estimate = run_time.estimate(request) if run_time is not None else None
    if limit is not None and estimate is not None and estimate > limit:
        raise InvalidRequestError("sampling_params", (
            f"would run about {estimate:.3g} s on this engine ({_size(request)}), "
            f"above max_request_seconds={limit:g}"))
    return request


def accept(request: object, spec: ModelSpec, config: EngineConfig,
           run_time: RunTimeModel | None = None,
           inputs: InputArena | None = None) -> DiffusionRequest:
    """Check one request end to end (``InvalidRequestError`` refuses it);
    return it as it will run. ``run_time`` estimates its seconds for
    ``max_request_seconds`` (None: not checked). Its input images are
    converted and written into ``inputs`` (``input_images``); the returned
    request holds their handles and ``input_images.release`` frees them."""
    request = check(request, spec, config, run_time)
    params = request.sampling_params
    # The engine's own copy (a caller mutating its request later changes
    # nothing), with the seed drawn here when none was given so the output can
    # name it.
    seed = random_seed() if params.seed is None and params.seeds is None else params.seed
    request = msgspec.structs.replace(
        request, sampling_params=msgspec.structs.replace(params, seed=seed))
    if request.images:
        request = _stored_inputs(request, spec, inputs)
    try:
        msgspec.msgpack.encode(request)  # what the worker will receive
    except (TypeError, ValueError, OverflowError) as exc:
        release(request, inputs)
        raise InvalidRequestError("request", f"cannot be sent to a worker: {exc}") from None
    return request


def _stored_inputs(request: DiffusionRequest, spec: ModelSpec,
                   inputs: InputArena | None) -> DiffusionRequest:
    """``request`` with its images converted, resized as the model resizes
    them (``ModelSpec.input_size``) and moved into the input arena (their
    handles in their place)."""
    if inputs is None:
        raise InvalidRequestError("images", "this engine's executor carries no input images "
                                            "(the ray backend: serve edits with mp or inproc)")
    params = request.sampling_params
    prompt_size = spec.prompt_image_size(request)
    converted = to_arrays(list(request.images), request.mask_image,
                          lambda w, h: spec.input_size(request, w, h), prompt_size)
    total = converted.nbytes
    if total > inputs.size:
        raise InvalidRequestError("images", (
            f"{total} bytes of input pixels at {params.height}x{params.width}, more than "
            f"max_pending_input_bytes ({inputs.size})"))
    try:
        return store(request, converted, inputs)
    except InputArenaFullError as exc:
        raise InputsFullError(str(exc)) from None
    except InputArenaClosedError:
        raise EngineClosedError("engine closed") from None


def _splits_rows(config: EngineConfig) -> bool:
    """Several ranks share each request's rows (CFG or sequence parallelism)."""
    parallel = config.parallel
    return max(parallel.cfg_parallel_size, parallel.ulysses_degree, parallel.ring_degree) > 1


def _size(request: DiffusionRequest) -> str:
    """What the estimate was of, in the request's own terms."""
    params = request.sampling_params
    frames = f"{params.num_frames} frames of " if (params.num_frames or 1) > 1 else ""
    return (f"{frames}{filled(params.height)}x{filled(params.width)}, "
            f"{filled(params.num_inference_steps)} steps, n={params.num_outputs_per_prompt}")


def timeout_of(request: DiffusionRequest, now: float,
               config: EngineConfig) -> tuple[float | None, str | None]:
    """When a request submitted at ``now`` has run too long, and the error that
    names the limit: the engine's ``request_timeout_s`` or the request's own
    lower ``timeout_s``; (None, None) without a limit."""
    engine_limit = config.limits.request_timeout_s
    own = request.sampling_params.timeout_s
    if own is not None and (engine_limit is None or own < engine_limit):
        return now + own, f"request timed out after {own:g} s (timeout_s={own:g})"
    if engine_limit is not None:
        return now + engine_limit, (f"request timed out after {engine_limit:g} s "
                                    f"(request_timeout_s={engine_limit:g})")
    return None, None
