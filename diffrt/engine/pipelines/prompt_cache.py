"""An LRU cache of prompt embeddings, bounded in bytes.

Serving traffic repeats prompts (retries, several seeds of one prompt, the
empty negative prompt of every CFG request), and a real text encoder (T5-XXL
has 4.7 B parameters) costs more than a denoise step. The cache wraps any
pipeline text encoder — a callable ``prompts -> (embeds, extra)`` with one
row per prompt (rows of different text lengths are zero-padded when joined) — and encodes only the prompts it has not kept, all of them in
one call. Keys are the prompt text (one cache per text encoder, so the encoder
is part of the key by construction; a negative prompt is a prompt of its own).

It also counts what text encoding costs (``stats``): prompts encoded, prompts
served from the cache, and the seconds spent in the encoder. With a
``synchronize`` that waits for the current stream's work, the seconds include
the device work, not only its launch.
A ``max_bytes`` of 0 keeps nothing but still counts.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import torch

from diffrt.engine.outputs import TextEncoderStats


def cat_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Rows of several prompts in one tensor. Text of different lengths (a
    family whose prompts are not padded to a fixed length: Qwen-Image) is
    zero-padded along dim 1 to the longest, as diffusers pads a batch (the
    padding is masked out)."""
    if len(tensors) == 1:
        return tensors[0]
    if tensors[0].dim() >= 2 and len({t.shape[1] for t in tensors}) > 1:
        longest = max(t.shape[1] for t in tensors)
        tensors = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, longest - t.shape[1]))
                   for t in tensors]
    return torch.cat(tensors)


class TextEncoder(Protocol):
    """Prompts -> (embeds, extra), a row each, on ``device`` (a family's
    ``FolderTextEncoder``, or this cache around one)."""

    device: torch.device

    def __call__(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]: ...


class CachedTextEncoder:
    def __init__(self, encoder: TextEncoder, max_bytes: int,
                 synchronize: Callable[[], None] | None = None):
        self.encoder = encoder
        self.max_bytes = max_bytes
        self._synchronize = synchronize
        self._entries: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.seconds = 0.0

    @property
    def device(self) -> torch.device:
        """The wrapped encoder's device (set through the cache: set on it)."""
        return self.encoder.device

    @device.setter
    def device(self, device: torch.device) -> None:
        self.encoder.device = device

    def stats(self) -> TextEncoderStats:
        return TextEncoderStats(encoded=self.misses, cache_hits=self.hits, seconds=self.seconds)

    def tokens_dropped(self, prompt: str) -> dict[str, int]:
        """The wrapped encoder's count of the tokens it cuts from ``prompt``
        (``FolderTextEncoder.tokens_dropped``); {} from one that does not count."""
        counter = getattr(self.encoder, "tokens_dropped", None)
        return counter(prompt) if counter is not None else {}

    def __call__(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        missing = list(dict.fromkeys(p for p in prompts if p not in self._entries))
        fresh: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if missing:
            start = time.perf_counter()
            embeds, extra = self.encoder(missing)
            if self._synchronize is not None:
                self._synchronize()
            self.seconds += time.perf_counter() - start
            fresh = {p: (embeds[i:i + 1], extra[i:i + 1]) for i, p in enumerate(missing)}
        # counted once the encoder succeeded: a failed call encoded nothing
        self.misses += len(missing)
        self.hits += len(prompts) - len(missing)
        rows = []
        for prompt in prompts:
            entry = fresh.get(prompt)
            if entry is None:
                entry = self._entries[prompt]
                self._entries.move_to_end(prompt)
            rows.append(entry)
        for prompt, entry in fresh.items():
            self._put(prompt, entry)
        return cat_rows([e for e, _ in rows]), cat_rows([p for _, p in rows])

    def _put(self, prompt: str, entry: tuple[torch.Tensor, torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in entry)
        if size > self.max_bytes:  # also: max_bytes == 0, the cache is off
            return  # larger than the whole cache: never kept
        entry = (entry[0].clone(), entry[1].clone())  # own storage, not a batch's view
        self._entries[prompt] = entry
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= sum(t.numel() * t.element_size() for t in old)

    def __len__(self) -> int:
        return len(self._entries)
