"""A chunked video model's clip (Helios): how many chunks, and which frame
counts whole chunks give.

diffusers' ``HeliosPipeline`` denoises a clip in chunks of
``num_latent_frames_per_chunk`` latent frames (``ModelSpec.chunk_latent_frames``),
each decoding to a window of ``(chunk - 1) x frame_factor + 1`` frames; it
runs ``ceil(num_frames / window)`` chunks and cuts their frames to
``frame_factor`` x k + 1. A request here asks for a count whole chunks give
(33, 65, 97, 129, ... for Helios' 9-frame chunks), so the clip it gets has
the frames it asked for; its ``SamplingParams.chunks`` is set from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from diffrt.engine.sampling import InvalidRequestError, SamplingParams, filled

if TYPE_CHECKING:
    from diffrt.engine.model_spec import ModelSpec


def chunk_window(spec: ModelSpec) -> int:
    """The frames one chunk decodes to."""
    return (spec.chunk_latent_frames - 1) * spec.frame_factor + 1


def chunks_of(spec: ModelSpec, frames: int) -> int:
    """The chunks diffusers runs for a clip of ``frames`` frames."""
    return max(1, -(-frames // chunk_window(spec)))


def chunked_frames(spec: ModelSpec, chunks: int) -> int:
    """The frames a clip of ``chunks`` chunks has, cut as diffusers cuts them."""
    f = spec.frame_factor
    return (chunks * chunk_window(spec) - 1) // f * f + 1


def check_chunked(spec: ModelSpec, params: SamplingParams) -> None:
    """Refuse a frame count whole chunks do not give (diffusers would cut
    it to another) and ``partial_images`` (the chunks are the previews)."""
    frames = filled(params.num_frames)
    if frames > spec.max_frames or frames != chunked_frames(spec, chunks_of(spec, frames)):
        allowed = ", ".join(str(chunked_frames(spec, k)) for k in range(1, 4))
        raise InvalidRequestError("num_frames", (
            f"must be what whole chunks of {chunk_window(spec)} frames give ({allowed}, ...) "
            f"and at most {spec.max_frames} for {spec.name}, got {frames}"))
    if params.partial_images:
        raise InvalidRequestError("partial_images", (
            f"{spec.name} streams each finished chunk's frames as its previews; "
            "partial_images does not apply"))


__all__ = ["check_chunked", "chunk_window", "chunked_frames", "chunks_of"]
