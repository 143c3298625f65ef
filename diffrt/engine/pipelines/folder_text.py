"""A model folder's own text encoders, run exactly as diffusers runs them.

A diffusers folder ships its text encoders and tokenizers (CLIP, T5). Rather
than re-implementing each family's prompt encoding (CLIP's penultimate hidden
state, pooled outputs, T5 padding and maximum lengths, how SD3 concatenates
them), the family's diffusers pipeline is built around the loaded encoders
alone (no transformer, VAE or scheduler) and its own ``encode_prompt`` is
called. So a prompt is conditioned exactly as diffusers would condition it,
and a new family only names its diffusers pipeline and the arguments its
``encode_prompt`` takes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline as DiffusersPipeline
    from transformers import PreTrainedTokenizerBase


class PromptWindow(NamedTuple):
    """How much of a prompt one of the folder's text encoders sees: its
    tokenizer cuts the text (``template`` with the prompt in it) at
    ``max_tokens`` tokens, as the family's diffusers ``encode_prompt`` calls it."""

    #: the folder's component whose input this is ("text_encoder_2")
    encoder: str
    tokenizer: PreTrainedTokenizerBase
    max_tokens: int
    template: str = "{}"

    def tokens_dropped(self, prompt: str) -> int:
        """Tokens of ``prompt`` this encoder never sees. A text of at most
        ``max_tokens - 2`` characters is never cut (a token covers at least one
        character; two for the begin and end markers), so the usual short
        prompt costs no second tokenization."""
        text = self.template.format(prompt)
        if len(text) + 2 <= self.max_tokens:
            return 0
        ids = self.tokenizer(text, truncation=False, verbose=False)["input_ids"]
        return max(0, len(ids) - self.max_tokens)


class FolderTextEncoder:
    """Callable as the pipelines' text encoder: prompts -> (embeds, pooled)."""

    def __init__(self, text_pipeline: DiffusersPipeline,
                 encode: Callable[[DiffusersPipeline, list[str], torch.device],
                                  tuple[torch.Tensor, torch.Tensor]], *,
                 device: torch.device, windows: Sequence[PromptWindow] = ()):
        self.pipeline = text_pipeline
        self._encode = encode
        self.windows = tuple(windows)
        #: where the prompts' tensors go (the compute device)
        self.device = device

    def tokens_dropped(self, prompt: str) -> dict[str, int]:
        """Text encoder -> the tokens of ``prompt`` it cuts, for those that cut any."""
        cuts = {w.encoder: w.tokens_dropped(prompt) for w in self.windows}
        return {name: n for name, n in cuts.items() if n}

    @torch.no_grad()
    def __call__(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        return self._encode(self.pipeline, list(prompts), self.device)
