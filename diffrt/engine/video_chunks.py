"""A chunked video model's clip (Helios): how many chunks, and which frame
counts whole chunks give.

diffusers' ``HeliosPipeline`` denoises a clip in chunks of ``chunk``
latent frames (``ModelSpec.chunk_latent_frames``), each decoding to a
window of ``(chunk - 1) x factor + 1`` frames (``factor``: the VAE's
``frame_factor``); it runs ``ceil(num_frames / window)`` chunks and cuts
their frames to ``factor`` x k + 1. A request here asks for a count whole
chunks give (33, 65, 97, 129, ... for Helios' 9-frame chunks), so the clip
it gets has the frames it asked for; its ``SamplingParams.chunks`` is set
from it.
"""

from __future__ import annotations

from diffrt.engine.sampling import InvalidRequestError, SamplingParams, filled


def chunk_window(chunk: int, factor: int) -> int:
    """The frames one chunk decodes to."""
    return (chunk - 1) * factor + 1


def chunks_of(frames: int, chunk: int, factor: int) -> int:
    """The chunks diffusers runs for a clip of ``frames`` frames."""
    return max(1, -(-frames // chunk_window(chunk, factor)))


def chunked_frames(chunks: int, chunk: int, factor: int) -> int:
    """The frames a clip of ``chunks`` chunks has, cut as diffusers cuts them."""
    return (chunks * chunk_window(chunk, factor) - 1) // factor * factor + 1


def check_chunked(params: SamplingParams, chunk: int, factor: int, max_frames: int,
                  model: str) -> None:
    """Refuse a frame count whole chunks do not give (diffusers would cut
    it to another) and ``partial_images`` (the chunks are the previews)."""
    frames = filled(params.num_frames)
    if frames > max_frames or frames != chunked_frames(chunks_of(frames, chunk, factor),
                                                       chunk, factor):
        allowed = ", ".join(str(chunked_frames(k, chunk, factor)) for k in range(1, 4))
        raise InvalidRequestError("num_frames", (
            f"must be what whole chunks of {chunk_window(chunk, factor)} frames give "
            f"({allowed}, ...) and at most {max_frames} for {model}, got {frames}"))
    if params.partial_images:
        raise InvalidRequestError("partial_images", (
            f"{model} streams each finished chunk's frames as its previews; "
            "partial_images does not apply"))


__all__ = ["check_chunked", "chunk_window", "chunked_frames", "chunks_of"]
