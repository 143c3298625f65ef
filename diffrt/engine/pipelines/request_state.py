"""The typed parts of a request's step state (``StepRequestState``).

Each is what one stage of the denoise loop leaves for a later one, and the
tensors that travel together travel in one struct: the prompt embeddings
(``Conditioning``, from the conditioning stage to every step), an
inpainting request's blend inputs (``Inpaint``, read after every step) and
its pixel overlay (``Overlay``, read at decode), an edit's input-image
tokens (``EditTokens``, appended to the row's own in every step). A family
that needs state of its own keeps it in ``StepRequestState.family_state``,
a struct of its choosing; ``StepRequestState.nbytes`` counts the tensors of
all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffrt.engine.pipelines.prompt_cache import cat_rows


@dataclass
class Conditioning:
    """Prompt embeddings for a group of rows (uncond only when CFG runs).
    ``extra`` is the family's second text output: CLIP's pooled embedding
    (Flux, SD3), the text mask (Qwen-Image)."""

    embeds: torch.Tensor
    extra: torch.Tensor
    neg_embeds: torch.Tensor | None = None
    neg_extra: torch.Tensor | None = None

    @staticmethod
    def cat(parts: list[Conditioning]) -> Conditioning:
        """The rows of ``parts`` one after another (negatives: all or none
        have them, the step batch key says whether CFG runs)."""
        negatives = [p.neg_embeds for p in parts if p.neg_embeds is not None]
        extras = [p.neg_extra for p in parts if p.neg_extra is not None]
        return Conditioning(
            embeds=cat_rows([p.embeds for p in parts]),
            extra=cat_rows([p.extra for p in parts]),
            neg_embeds=cat_rows(negatives) if negatives else None,
            neg_extra=cat_rows(extras) if extras else None,
        )


@dataclass
class Inpaint:
    """An inpainting request's blend inputs, in the transformer's latent
    layout: outside ``mask`` (1: repaint) each step's latents are
    ``image_latents`` noised by ``noise`` to the next step."""

    mask: torch.Tensor
    image_latents: torch.Tensor
    noise: torch.Tensor

    def keep_outside(self, inside: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
        """``inside`` where the mask repaints, ``outside`` elsewhere."""
        return (1 - self.mask) * outside + self.mask * inside


@dataclass
class Overlay:
    """An inpainting request's input pixels, pasted back outside the mask
    after decoding: ``mask`` (1, 1, H, W) of 0 / 1 and ``pixels`` (1, 3, H, W)
    in [-1, 1]."""

    mask: torch.Tensor
    pixels: torch.Tensor

    def paste(self, images: torch.Tensor) -> torch.Tensor:
        return self.mask * images + (1 - self.mask) * self.pixels


@dataclass
class EditTokens:
    """An edit's input images as tokens that follow the row's own in every
    step (FLUX.1 Kontext, Qwen-Image-Edit): ``tokens`` (rows, tokens, dim)
    and each image's latent (height, width), in order."""

    tokens: torch.Tensor
    sizes: tuple[tuple[int, int], ...]


__all__ = ["Conditioning", "EditTokens", "Inpaint", "Overlay"]
