"""Sequence-parallel attention: each rank holds a slice of the sequence.

Shapes follow ``torch.nn.functional.scaled_dot_product_attention``:
``(batch, heads, sequence, head_dim)``, here with this rank's slice of the
sequence (every rank the same length: the callers split only sequences that
divide). Both functions
return this rank's slice of the output, equal (up to float rounding) to
full attention over the whole sequence.

- **Ulysses** (DeepSpeed-Ulysses, as in xDiT's USP and vllm-omni): one
  ``all_to_all_single`` (q, k and v together) turns "my tokens, all heads"
  into "all tokens, my heads", attention runs locally on whole sequences, a
  second all-to-all turns the output back. Needs ``heads % world == 0``.
- **Ring**: queries stay; key/value slices travel round the ring, each rank
  attends to one slice per hop and merges the partial results by their
  log-sum-exp. Any head count; world - 1 hops of k and v.

gloo (the CPU backend) has ``all_to_all_single`` but not the list form, so
only the former is used.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def _seq_to_heads(x: torch.Tensor, world: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(B, H, S, D), this rank's tokens -> (B, H/world, world*S, D), its heads."""
    b, h, s, d = x.shape
    chunks = x.reshape(b, world, h // world, s, d).permute(1, 0, 2, 3, 4).contiguous()
    received = torch.empty_like(chunks)
    dist.all_to_all_single(received, chunks, group=group)  # [j]: rank j's tokens, my heads
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * s, d)


def _heads_to_seq(x: torch.Tensor, world: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(B, H/world, world*S, D), this rank's heads -> (B, H, S, D), its tokens."""
    b, h, ss, d = x.shape
    s = ss // world
    chunks = x.reshape(b, h, world, s, d).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(chunks)
    dist.all_to_all_single(received, chunks, group=group)  # [j]: my tokens, rank j's heads
    return received.permute(1, 0, 2, 3, 4).reshape(b, world * h, s, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Attention over the whole sequence from this rank's slice of it (see the
    module docstring); ``heads`` must divide by the group's size."""
    return joint_ulysses_attention(q, k, v, 0, group)


#: attention over (q, k, v) whose first ``text_len`` tokens are text; an
#: optional ``text_mask`` (B, text_len), True for real text tokens, keeps
#: padded text out of every softmax (Qwen-Image batches prompts of different
#: lengths)
JointAttention = Callable[..., torch.Tensor]


def _key_mask(text_mask: torch.Tensor | None, keys: int) -> torch.Tensor | None:
    """(B, keys) with the text mask in front and every image key kept."""
    if text_mask is None:
        return None
    image = torch.ones(text_mask.shape[0], keys - text_mask.shape[1], dtype=torch.bool,
                       device=text_mask.device)
    return torch.cat([text_mask.to(torch.bool), image], dim=1)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text_len: int = 0,
                    text_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over the tokens held here (text and image alike)."""
    mask = _key_mask(text_mask, k.shape[2])
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=None if mask is None else mask[:, None, None, :])


def joint_ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text_len: int,
                            group: dist.ProcessGroup | None = None,
                            inner: JointAttention = local_attention,
                            text_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Ulysses for joint attention (Flux, SD3): the first ``text_len`` tokens
    are text, the same on every rank; the rest is this rank's slice of the
    image tokens. Text takes this rank's heads by slicing (it is replicated),
    image tokens by the all-to-all; after attention the text output is
    gathered over heads and the image output sent back to its tokens.
    Layout (B, H, tokens, D); returns the same shape as ``q``.

    ``inner`` attends over what the all-to-all gathered; ring attention there
    makes the two combined (USP): Ulysses inside a group of ranks, the ring
    across such groups, each holding a contiguous block of the image."""
    world = _world(group)
    if world == 1:
        return inner(q, k, v, text_len, text_mask=text_mask)
    heads = q.shape[1]
    if heads % world:
        raise ValueError(f"Ulysses attention needs heads ({heads}) divisible by the "
                         f"sequence-parallel degree ({world}); ring attention takes any count")
    rank = dist.get_rank(group)
    mine = slice(rank * heads // world, (rank + 1) * heads // world)

    b = q.shape[0]
    # q, k and v in one all-to-all (stacked along the batch)
    image = _seq_to_heads(torch.cat([q[:, :, text_len:], k[:, :, text_len:],
                                     v[:, :, text_len:]]), world, group)
    lq, lk, lv = (torch.cat([x[:, mine, :text_len], image[i * b:(i + 1) * b]], dim=2)
                  for i, x in enumerate((q, k, v)))
    out = inner(lq, lk, lv, text_len, text_mask=text_mask)
    image = _heads_to_seq(out[:, :, text_len:].contiguous(), world, group)
    if not text_len:
        return image
    text = [torch.empty_like(out[:, :, :text_len]) for _ in range(world)]
    dist.all_gather(text, out[:, :, :text_len].contiguous(), group=group)
    return torch.cat([torch.cat(text, dim=1), image], dim=2)


#: float32 score elements one block of queries may hold (256 MiB)
SCORE_BUDGET = 64 << 20


def _attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     key_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q over one block of k, v and the log-sum-exp of its
    scores (B, H, Sq), in float32 so blocks merge without loss. Queries go in
    chunks so the score matrix stays within ``SCORE_BUDGET`` elements
    (Flux at 2048² would otherwise hold gigabytes of scores per hop)."""
    b, h, sq, _ = q.shape
    step = max(1, SCORE_BUDGET // max(1, b * h * k.shape[2]))
    kf, vf, scale = k.float().transpose(-1, -2), v.float(), 1.0 / math.sqrt(q.shape[-1])
    outs, lses = [], []
    for start in range(0, sq, step):
        scores = torch.matmul(q[:, :, start:start + step].float(), kf) * scale
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), vf))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmax results over disjoint key blocks -> one."""
    new_lse = torch.logaddexp(lse, block_lse)
    out = (out * torch.exp(lse - new_lse).unsqueeze(-1)
           + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
    return out, new_lse


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Attention over the whole sequence from this rank's slice of it, passing
    key/value slices round the ring (any head count)."""
    return joint_ring_attention(q, k, v, 0, group)


def joint_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text_len: int,
                         group: dist.ProcessGroup | None = None,
                         text_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Ring attention for joint attention: the first ``text_len`` tokens are
    text, the same on every rank, attended to once (in the local block); only
    the image slices travel. Every rank's text queries see every key, so the
    text output needs no exchange. Layout (B, H, tokens, D)."""
    world = _world(group)
    if world == 1:
        return local_attention(q, k, v, text_len, text_mask=text_mask)
    rank = dist.get_rank(group)
    to_rank = dist.get_global_rank(group, (rank + 1) % world) if group else (rank + 1) % world
    from_rank = (dist.get_global_rank(group, (rank - 1) % world) if group
                 else (rank - 1) % world)
    out, lse = _attend_with_lse(q, k, v, _key_mask(text_mask, k.shape[2]))
    kv = torch.stack([k[:, :, text_len:], v[:, :, text_len:]]).contiguous()
    for _ in range(world - 1):
        incoming = torch.empty_like(kv)
        ops = [dist.P2POp(dist.isend, kv, to_rank, group),
               dist.P2POp(dist.irecv, incoming, from_rank, group)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        kv = incoming
        block_out, block_lse = _attend_with_lse(q, kv[0], kv[1])
        out, lse = _merge(out, lse, block_out, block_lse)
    return out.to(q.dtype)


__all__ = ["JointAttention", "joint_ring_attention", "joint_ulysses_attention",
           "local_attention", "ring_attention", "ulysses_attention"]
