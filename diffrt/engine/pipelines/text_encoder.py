"""A download-free text encoder: deterministic hashed-token embeddings.

The reference pipelines must run offline, so instead of CLIP/T5 a prompt is
split into lower-cased word and punctuation tokens, and every token maps to a
fixed random vector drawn from a ``torch.Generator`` seeded by a BLAKE2 hash
of the token. The same token gives the same vector in every process and on
every machine; there is no vocabulary and nothing to download. A fixed
positional vector is added per position so word order matters.

The sequence length is fixed (``max_tokens``, zero-padded, longer prompts
truncated) so that a request's conditioning never depends on the prompts of
its batch mates. The pooled vector is the mean of the tokens' pooled vectors
(zeros for an empty prompt).

This conditions the transformer deterministically; it carries no semantics.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache

import torch

_TOKEN_RE = re.compile(r"\w+|[^\w\s]")
_POSITION_SCALE = 0.5


def tokenize(prompt: str) -> list[str]:
    """Lower-cased word and punctuation tokens of ``prompt``."""
    return _TOKEN_RE.findall(prompt.lower())


def _stable_seed(text: str) -> int:
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@lru_cache(maxsize=65536)
def _vector(key: str, dim: int) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(_stable_seed(key))
    return torch.randn(dim, generator=generator, dtype=torch.float32)


class HashedTextEncoder:
    """Maps prompts to (embeds (B, max_tokens, dim), pooled (B, pooled_dim)) on CPU."""

    def __init__(self, dim: int, pooled_dim: int, max_tokens: int = 32, salt: str = "diffrt"):
        self.dim = dim
        self.pooled_dim = pooled_dim
        self.max_tokens = max_tokens
        self.salt = salt

    def encode_one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """One prompt -> (max_tokens, dim) embeddings and a (pooled_dim,) vector."""
        tokens = tokenize(prompt)[: self.max_tokens]
        embeds = torch.zeros(self.max_tokens, self.dim)
        pooled = torch.zeros(self.pooled_dim)
        for i, token in enumerate(tokens):
            embeds[i] = _vector(f"{self.salt}:tok:{token}", self.dim) + _POSITION_SCALE * _vector(
                f"{self.salt}:pos:{i}", self.dim
            )
            pooled += _vector(f"{self.salt}:pool:{token}", self.pooled_dim)
        if tokens:
            pooled /= len(tokens)
        return embeds, pooled

    def __call__(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [self.encode_one(p) for p in prompts]
        return torch.stack([e for e, _ in pairs]), torch.stack([p for _, p in pairs])
