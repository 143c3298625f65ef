"""A Helios request's chunks: what it keeps between them and what each call reads.

diffusers' ``HeliosPipeline`` denoises chunk ``k`` with the latents of the
chunks before it as context: the last ``sum(HISTORY_SIZES)`` (19) latent
frames, split into a long (16), a mid (2) and a short (1) history, the
short one after a prefix (zeros for the first chunk, then chunk 0's first
latent frame, ``keep_first_frame``), each patched at its own scale by the
transformer (``patch_long`` / ``patch_mid`` / ``patch_short``) at fixed
frame indices. ``ChunkState`` is that state per request (its
``StepRequestState.family_state``) with the request's noise generator,
which draws each chunk's noise in turn as diffusers' one generator does;
``history_tokens`` packs the history as the rows' conditioning tokens
(``Conditioning.extra``), so requests at different chunks share a call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: HeliosPipeline's ``history_sizes`` default: latent frames of earlier
#: chunks in its long, mid and short history (newest last)
HISTORY_SIZES = (16, 2, 1)
#: latent frames of a call's history input: long, mid, then the prefix and the short one
HISTORY_FRAMES = sum(HISTORY_SIZES) + 1
#: how ``HISTORY_FRAMES`` split into the transformer's three inputs
HISTORY_SPLIT = (HISTORY_SIZES[0], HISTORY_SIZES[1], HISTORY_SIZES[2] + 1)


@dataclass
class ChunkState:
    """One request's chunks so far (see the module)."""

    #: draws each chunk's noise, in order (the request's seed)
    generator: torch.Generator
    #: (N, C, 19, h, w): the newest latent frames, last newest (zeros at first)
    history: torch.Tensor
    #: chunk 0's first latent frame, once chunk 0 is done (None: zeros)
    prefix: torch.Tensor | None = None
    #: each finished chunk's frames (N, 3, window, H, W), or latents for "latent"
    outputs: list[torch.Tensor] = field(default_factory=list)
    #: the newest finished chunk, until its preview takes it
    fresh: torch.Tensor | None = None

    def add(self, latents: torch.Tensor, output: torch.Tensor) -> None:
        """A finished chunk's (N, C, F, h, w) latents and its output."""
        if self.prefix is None:
            self.prefix = latents[:, :, :1]
        self.history = torch.cat([self.history, latents], dim=2)[:, :, -sum(HISTORY_SIZES):]
        self.outputs.append(output)
        self.fresh = output

    def history_tokens(self) -> torch.Tensor:
        """The history as one row of tokens per output, (N, 20·h·w, C):
        long, mid, prefix, short, each frame's latents in raster order."""
        long, mid, short = self.history.split(HISTORY_SIZES, dim=2)
        prefix = self.prefix if self.prefix is not None else torch.zeros_like(short[:, :, :1])
        return torch.cat([long, mid, prefix, short], dim=2).flatten(2).transpose(1, 2)


def history_inputs(tokens: torch.Tensor, height: int, width: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``history_tokens`` (rows of one latent size; padding past them cut)
    -> the transformer's (long, mid, short) history latents."""
    n, _, c = tokens.shape
    frames = tokens[:, :HISTORY_FRAMES * height * width].transpose(1, 2)
    long, mid, short = frames.reshape(n, c, HISTORY_FRAMES, height, width).split(HISTORY_SPLIT,
                                                                                   dim=2)
    return long, mid, short


def frame_indices(chunk: int) -> dict[str, torch.Tensor]:
    """The transformer's frame-index inputs (``keep_first_frame``), as
    HeliosPipeline builds them: the prefix at 0, the histories after it,
    the chunk last; the short history is the prefix and its own frame."""
    sizes = [1, *HISTORY_SIZES, chunk]
    prefix, long, mid, short, hidden = torch.arange(sum(sizes)).split(sizes)
    return {"indices_hidden_states": hidden[None],
            "indices_latents_history_short": torch.cat([prefix, short])[None],
            "indices_latents_history_mid": mid[None],
            "indices_latents_history_long": long[None]}


def first_chunk_inputs(latents: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every history input of the transformer for a text-to-video request's
    first chunk, whose (N, C, F, h, w) ``latents`` are given: zeros in place
    of earlier chunks (long, mid, and the short one after its zero prefix),
    at HeliosPipeline's frame indices. A call outside the pipeline (training
    on single-chunk clips, probing a model) passes these as the pipeline does."""
    n, c, f, h, w = latents.shape
    long, mid, short = latents.new_zeros(n, c, HISTORY_FRAMES, h, w).split(HISTORY_SPLIT, dim=2)
    return {**frame_indices(f), "latents_history_long": long, "latents_history_mid": mid,
            "latents_history_short": short}


__all__ = ["HISTORY_FRAMES", "HISTORY_SIZES", "ChunkState", "first_chunk_inputs",
           "frame_indices", "history_inputs"]
