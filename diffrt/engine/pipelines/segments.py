"""The rows of one transformer call, and how rows of different sizes share it.

A *row* is one image's pass through the transformer: a request has
``num_outputs_per_prompt`` rows, and twice that while classifier-free
guidance runs both branches in one call (``ModelSpec.rows`` counts the same).
A request's *segment* is its rows in a call (consecutive: states are laid out
in order) together with the image-token range each of them fills, ``[0,
tokens)`` of the call's image tokens (``RowLayout.tokens``; where the text
sits around them is the family's: before them in Flux and Qwen-Image, after
them in SD3). The later per-request capabilities (adapters, caches) index a
call by segment; this module has the layout they build on (``RowLayout``),
not yet a segment type of its own.

Rows of different sizes share a *step* in one of three ways
(``ModelConfig.mixed_rows``, resolved by ``resolve_mixed_rows``): ``padded``,
one transformer call for all rows (below); ``by_size``, one call per size
among them, each diffrt's uniform path; or ``packed`` (Flux,
``flux/packed.py``), one call over all rows' tokens in one sequence.
Measured on CPU (docs/engine.md, "Mixed sizes in one step"), none is faster
beyond the machine's noise except that ``padded`` is slowest where rows
differ most: a CPU gains nothing from one larger call, and padding costs its
computed tokens and attention's mask. ``by_size`` is the CPU default (every
family, diffusers' own forward size by size). Padded steps run the transformer's
modules eagerly, outside a ``torch.compile``d forward (``compile``), and the
memory budget estimates each request as if unpadded (on CPU, where
``by_size`` is the default, nothing is padded). On a device one call saves
launches, so ``auto`` pads there (not measured here: no device was lent). Where the
platform supplies a variable-length attention (``Platform.varlen_attention``:
flash-attention's ``flash_attn_varlen_func`` on CUDA and ROCm when installed),
a padded call's attention runs over each row's real tokens only
(``masked_attention``), so padding costs only the linear layers.

In ``padded`` mode rows of different image sizes share a call by padding: every row's image
tokens are zero-padded at the end to the call's longest row, and attention
masks the padding out as keys (``RowLayout.key_mask``). What a padded query
computes is never read: each segment's prediction is cut back to its own
tokens (``FlowMatchPipeline.split_predictions``). Each row keeps its own
positions (the family builds them per size) and its own modulation (the
timestep and guidance embeddings are per row already).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from diffusers import ModelMixin

    from diffrt.engine.cache.state import RequestCache

if TYPE_CHECKING:
    from diffrt.platforms.interface import Platform


@dataclass(frozen=True)
class RowLayout:
    """The image of each row of one transformer call: its latent (height,
    width) and image tokens, in row order; and each row's LoRA adapters as
    (device slot, scale) pairs (``loras``: () when no row has any;
    ``engine.lora.row_lora`` applies them)."""

    #: (height, width); a video's (frames, height, width) (``latents.LatentSize``)
    sizes: tuple[tuple[int, ...], ...]
    tokens: tuple[int, ...]
    loras: tuple[tuple[tuple[int, float], ...], ...] = ()
    #: each row's conditioning images' latent (height, width)s, () for a row
    #: without any (``conds``: () when no row has any): an edit's input images
    #: (FLUX.1 Kontext, Qwen-Image-Edit) whose tokens follow the row's own, in
    #: order, counted in ``tokens``
    conds: tuple[tuple[tuple[int, int], ...], ...] = ()
    #: each row's request step cache (``engine.cache.RequestCache``; None: a
    #: row without one; (): no row has one): the rows of one request, over
    #: its outputs and CFG branches, share the same object
    caches: tuple[RequestCache | None, ...] = ()

    @staticmethod
    def uniform_rows(size: tuple[int, ...], tokens: int, rows: int,
                     loras: tuple[tuple[int, float], ...] = (),
                     cond: tuple[tuple[int, int], ...] = (),
                     cache: RequestCache | None = None) -> RowLayout:
        return RowLayout((size,) * rows, (tokens,) * rows, (loras,) * rows if loras else (),
                         (cond,) * rows if cond else (), (cache,) * rows if cache else ())

    @staticmethod
    def join(parts: list[RowLayout]) -> RowLayout:
        """The rows of ``parts`` one after another."""
        loras = () if not any(p.loras for p in parts) else tuple(
            uses for p in parts for uses in (p.loras or ((),) * len(p)))
        conds = () if not any(p.conds for p in parts) else tuple(
            c for p in parts for c in (p.conds or ((),) * len(p)))
        caches = () if not any(p.caches for p in parts) else tuple(
            c for p in parts for c in (p.caches or (None,) * len(p)))
        return RowLayout(tuple(size for p in parts for size in p.sizes),
                         tuple(n for p in parts for n in p.tokens), loras, conds, caches)

    def cond_of(self, row: int) -> tuple[tuple[int, int], ...]:
        return self.conds[row] if self.conds else ()

    @property
    def uniform(self) -> bool:
        """Every row has the same size and conditioning (no padding, no mask)."""
        return len(set(self.sizes)) <= 1 and len(set(self.conds)) <= 1

    @property
    def longest(self) -> int:
        return max(self.tokens)

    def __len__(self) -> int:
        return len(self.sizes)

    def __add__(self, other: RowLayout) -> RowLayout:
        return RowLayout.join([self, other])

    def rows(self, index: slice) -> RowLayout:
        """The layout of the rows ``index`` selects (a CFG-parallel rank's share)."""
        loras = self.loras[index] if self.loras else ()
        conds = self.conds[index] if self.conds else ()
        caches = self.caches[index] if self.caches else ()
        return RowLayout(self.sizes[index], self.tokens[index], loras if any(loras) else (),
                         conds if any(conds) else (),
                         caches if any(c is not None for c in caches) else ())

    def key_mask(self, text_tokens: int, device: torch.device) -> torch.Tensor:
        """(rows, text_tokens + longest) booleans, True where a key is a real
        token (text first, then the row's image tokens): a padded call's."""
        image = torch.arange(self.longest, device=device)[None, :] < torch.tensor(
            self.tokens, device=device)[:, None]
        text = torch.ones(len(self), text_tokens, dtype=torch.bool, device=device)
        return torch.cat([text, image], dim=1)


@contextlib.contextmanager
def attention_processor(model: ModelMixin, processor: Callable[..., object]
                        ) -> Iterator[None]:
    """``model``'s attention processors are ``processor`` while the block runs
    (diffrt's per-row variants of diffusers' own), its own again after."""
    kept = model.attn_processors
    model.set_attn_processor(processor)
    try:
        yield
    finally:
        model.set_attn_processor(kept)


def pad_tokens(parts: list[torch.Tensor], longest: int) -> torch.Tensor:
    """Row groups of (rows, tokens, channels) in one (rows, longest, channels)
    tensor, each zero-padded at the end of its tokens."""
    return torch.cat([part if part.shape[1] == longest else torch.nn.functional.pad(
        part, (0, 0, 0, longest - part.shape[1])) for part in parts])


def resolve_mixed_rows(setting: str, platform: Platform
                       ) -> Literal["padded", "by_size", "packed"]:
    """``ModelConfig.mixed_rows``, ``auto`` resolved for ``platform`` (see the module)."""
    if setting == "auto":
        return "by_size" if platform.device_type == "cpu" else "padded"
    if setting in ("by_size", "packed"):
        return setting  # type: ignore[return-value]
    return "padded"


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     key_mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of rows whose keys ``key_mask`` (rows, tokens; True: a real
    token) marks, ``query``/``key``/``value`` (rows, heads, tokens, dim) as
    torch's SDPA takes them. Through the platform's variable-length attention
    when it has one for this dtype: each row's real tokens packed one after
    another, attending to their own row's (a padded query's output is 0,
    never read); else SDPA with the mask."""
    import torch.nn.functional as F

    if key_mask is None:
        return F.scaled_dot_product_attention(query, key, value)
    from diffrt.platforms import current_platform

    varlen = current_platform.varlen_attention(query.dtype)
    if varlen is None:
        return F.scaled_dot_product_attention(query, key, value,
                                              attn_mask=key_mask[:, None, None, :])
    rows, heads, tokens, dim = query.shape
    real = key_mask.reshape(-1).nonzero().squeeze(1)
    lengths = key_mask.sum(dim=1, dtype=torch.int32)
    starts = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))

    def packed(x: torch.Tensor) -> torch.Tensor:  # (real tokens, heads, dim)
        return x.transpose(1, 2).reshape(rows * tokens, heads, -1)[real]

    out = varlen(packed(query), packed(key), packed(value), starts, int(lengths.max()))
    full = out.new_zeros(rows * tokens, heads, out.shape[-1])
    full[real] = out
    return full.view(rows, tokens, heads, -1).transpose(1, 2)
