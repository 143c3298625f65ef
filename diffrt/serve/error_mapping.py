"""An image route's refusals as HTTP answers: the engine's own (a field it
refused: 400 naming the body's field; capacity, deadline, restart: 429/503
with Retry-After) and a final output without an image (504, 503, 500).
``ImageRoute`` says how a route names things: its stream's events, and the
body's names of engine fields (an edit's ``mask`` for ``mask_image``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from diffrt.engine import DiffusionOutput, InvalidRequestError
from diffrt.engine.errors import (
    DeadlineUnmeetableError,
    EngineError,
    EngineRestartingError,
    InputsFullError,
)
from diffrt.serve.errors import ApiError

#: the Retry-After of a request refused while fresh workers start (as for a
#: server still loading: workers take seconds to start)
RESTART_RETRY_AFTER_S = 5
#: the Retry-After of a request whose input images find no room among those
#: of the requests held (they free as those finish: seconds at most)
INPUTS_RETRY_AFTER_S = 1
#: engine field -> the API field a client set it with
_PARAMS = {"height": "size", "width": "size", "num_outputs_per_prompt": "n",
           "sampling_params": "size", "num_inference_steps": "num_inference_steps",
           "deadline_s": "deadline_ms", "timeout_s": "timeout_ms"}


@dataclass(frozen=True)
class ImageRoute:
    """What differs between the routes that answer with images: the stream's
    event names (``<events>.partial_image``, ``<events>.completed``) and the
    body's names of engine fields beyond ``_PARAMS`` (an edit's images: its
    refusals are reworded with them, "mask_image: ..." as "mask: ...")."""

    events: str
    params: Mapping[str, str] = field(default_factory=dict)


GENERATION = ImageRoute("image_generation")


def invalid(exc: InvalidRequestError, route: ImageRoute = GENERATION) -> ApiError:
    """The 400 of an engine refusal, naming the field as the body names it."""
    message = str(exc)
    param = route.params.get(exc.field)
    if param is None:
        param = _PARAMS.get(exc.field, exc.field)
    elif message.startswith(f"{exc.field}: "):
        message = f"{param}: {message[len(exc.field) + 2:]}"
    return ApiError(400, message, param=param, code="invalid_value")

def engine_error(exc: EngineError) -> ApiError:
    """The answer of an engine that refused a request: 429 when its deadline
    cannot be met behind the queue (``refuse_unmeetable``; retry when the
    engine expects the queue to have drained enough) or when the input images
    it holds leave no room for this one's (retry after
    ``INPUTS_RETRY_AFTER_S``), 503 restarting (retry after
    ``RESTART_RETRY_AFTER_S``) or down."""
    if isinstance(exc, DeadlineUnmeetableError):
        return ApiError(429, str(exc), param="deadline_ms", code="deadline_unmeetable",
                        headers={"Retry-After": str(int(exc.retry_after_s))})
    if isinstance(exc, InputsFullError):
        return ApiError(429, f"{exc}; retry shortly", code="input_images_full",
                        headers={"Retry-After": str(INPUTS_RETRY_AFTER_S)})
    if isinstance(exc, EngineRestartingError):
        return ApiError(503, str(exc), code="engine_restarting",
                        headers={"Retry-After": str(RESTART_RETRY_AFTER_S)})
    return ApiError(503, f"the engine is down: {exc}", code="engine_down")

def raise_for_final(out: DiffusionOutput, client: Any) -> None:
    """The HTTP error for a final output that carries no image."""
    if out.ok:
        return
    if out.timed_out:
        raise ApiError(504, out.error or "the request timed out", code="timeout")
    if out.aborted:
        raise ApiError(503, "the server is shutting down; the request was stopped",
                       code="shutting_down")
    if not client.healthy():
        raise ApiError(503, f"the engine failed: {out.error}", code="engine_down")
    raise ApiError(500, f"generation failed: {out.error}", code="generation_failed")


__all__ = ["GENERATION", "ImageRoute", "engine_error", "invalid", "raise_for_final"]
