"""Run inside each rank of a gloo group (tests/engine/test_parallel_layers.py):
every parallel layer against its single-process reference, in one group."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _full(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _my_slice(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return x.chunk(world, dim=2)[rank].contiguous()


def run_checks(rank: int, world: int, init_method: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        from diffrt.engine.parallel import cfg_parallel_combine, ring_attention, ulysses_attention

        for name, fn, heads in (("ulysses", ulysses_attention, 2 * world),
                                ("ring", ring_attention, 3)):  # ring: heads need not divide
            q, k, v = (_full(seed, (2, heads, 4 * world, 16)) for seed in (1, 2, 3))
            want = _my_slice(F.scaled_dot_product_attention(q, k, v), rank, world)
            got = fn(_my_slice(q, rank, world), _my_slice(k, rank, world),
                     _my_slice(v, rank, world))
            err = (got - want).abs().max().item()
            assert err < 1e-5, f"{name} attention differs from full attention by {err}"
        # joint attention: 5 text tokens on every rank, the image tokens split
        from diffrt.engine.parallel.attention import joint_ring_attention, joint_ulysses_attention

        q, k, v = (_full(seed, (2, 2 * world, 5 + 4 * world, 16)) for seed in (7, 8, 9))
        full = F.scaled_dot_product_attention(q, k, v)
        mine = [torch.cat([x[:, :, :5], _my_slice(x[:, :, 5:], rank, world)], dim=2)
                for x in (q, k, v)]
        want = torch.cat([full[:, :, :5], _my_slice(full[:, :, 5:], rank, world)], dim=2)
        for name, fn in (("Ulysses", joint_ulysses_attention), ("ring", joint_ring_attention)):
            err = (fn(*mine, text_len=5) - want).abs().max().item()
            assert err < 1e-5, f"joint {name} attention differs from full attention by {err}"
        if world > 1:
            q = _full(4, (1, 3, 2 * world, 8))
            try:
                ulysses_attention(q, q, q)
            except ValueError as exc:
                assert "divisible" in str(exc)
            else:
                raise AssertionError("Ulysses accepted heads that do not divide")
        if world == 2:
            cond, uncond = _full(5, (2, 16, 8)), _full(6, (2, 16, 8))
            mine = cond if rank == 0 else uncond
            got = cfg_parallel_combine(mine, 4.0)
            assert torch.equal(got, uncond + 4.0 * (cond - uncond))
    finally:
        dist.destroy_process_group()
