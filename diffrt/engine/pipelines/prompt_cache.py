"""An LRU cache of prompt embeddings, bounded in bytes.

Serving traffic repeats prompts (retries, several seeds of one prompt, the
empty negative prompt of every CFG request), and a real text encoder (T5-XXL
has 4.7 B parameters) costs more than a denoise step. The cache wraps any
pipeline text encoder — a callable ``prompts -> (embeds, pooled)`` with one
row per prompt — and encodes only the prompts it has not kept, all of them in
one call. Keys are the prompt text (one cache per text encoder, so the encoder
is part of the key by construction).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch


class CachedTextEncoder:
    def __init__(self, encoder: Any, max_bytes: int):
        self.encoder = encoder
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def __call__(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        missing = list(dict.fromkeys(p for p in prompts if p not in self._entries))
        self.misses += len(missing)
        self.hits += len(prompts) - len(missing)
        fresh: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if missing:
            embeds, pooled = self.encoder(missing)
            fresh = {p: (embeds[i:i + 1], pooled[i:i + 1]) for i, p in enumerate(missing)}
        rows = []
        for prompt in prompts:
            entry = fresh.get(prompt)
            if entry is None:
                entry = self._entries[prompt]
                self._entries.move_to_end(prompt)
            rows.append(entry)
        for prompt, entry in fresh.items():
            self._put(prompt, entry)
        return torch.cat([e for e, _ in rows]), torch.cat([p for _, p in rows])

    def _put(self, prompt: str, entry: tuple[torch.Tensor, torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in entry)
        if size > self.max_bytes:
            return  # larger than the whole cache: never kept
        entry = (entry[0].clone(), entry[1].clone())  # own storage, not a batch's view
        self._entries[prompt] = entry
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= sum(t.numel() * t.element_size() for t in old)

    def __len__(self) -> int:
        return len(self._entries)
