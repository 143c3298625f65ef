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
        from diffrt.engine.parallel.attention import ring_attention, ulysses_attention
        from diffrt.engine.parallel.cfg import cfg_parallel_combine

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
        # padded text (a batch of prompts of different lengths): masked keys
        text_mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
        keys = torch.cat([text_mask, torch.ones(2, k.shape[2] - 5, dtype=torch.bool)], dim=1)
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=keys[:, None, None, :])
        masked = torch.cat([masked[:, :, :5], _my_slice(masked[:, :, 5:], rank, world)], dim=2)
        for name, fn in (("Ulysses", joint_ulysses_attention), ("ring", joint_ring_attention)):
            err = (fn(*mine, text_len=5, text_mask=text_mask) - masked).abs().max().item()
            assert err < 1e-5, f"masked joint {name} attention differs by {err}"
        from diffrt.engine.parallel import attention

        budget, attention.SCORE_BUDGET = attention.SCORE_BUDGET, 100  # queries in chunks of 1-2
        try:
            err = (joint_ring_attention(*mine, text_len=5) - want).abs().max().item()
            assert err < 1e-5, f"ring attention in query chunks differs by {err}"
        finally:
            attention.SCORE_BUDGET = budget
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
            _check_cfg_rows()
        if world == 4:
            _check_usp(rank)
        _check_vae_decode(world)
        _check_wan_video_vae_decode(world)
        _check_wan_video_tokens(world)
        if world == 2:  # a pipeline per rank: the 2-rank group only, to keep it short
            _check_wan_image_to_video_split()
    finally:
        dist.destroy_process_group()


def _check_cfg_rows() -> None:
    """A CFG-less batch of 3 rows: rank 0 computes 2, rank 1 one; both get all 3."""
    from diffrt.engine.parallel.cfg import gather_rows, rows_here

    batch = _full(10, (3, 4, 8))
    mine = rows_here(3)
    assert torch.equal(gather_rows(batch[mine] * 2, 3), batch * 2)
    one = _full(11, (1, 4, 8))
    assert rows_here(1) == slice(0, 1) and torch.equal(gather_rows(one, 1), one)


def _check_usp(rank: int) -> None:
    """Four ranks as ring 2 × Ulysses 2 (USP): each holds a quarter of the image
    tokens; joint attention over the sequence group equals full attention.
    Then CFG 2 × Ulysses 2: the groups hold the ranks the layout says."""
    from diffrt.engine.parallel import ParallelDegrees
    from diffrt.engine.parallel.groups import build_groups

    groups = build_groups(ParallelDegrees(ulysses=2, ring=2))
    q, k, v = (_full(seed, (2, 4, 5 + 16, 8)) for seed in (12, 13, 14))
    full = F.scaled_dot_product_attention(q, k, v)
    quarter = dist.get_rank(groups.sequence)
    assert quarter == rank  # cfg 1: the sequence group is the world, in rank order
    mine = [torch.cat([x[:, :, :5], x[:, :, 5:].chunk(4, dim=2)[quarter]], dim=2)
            for x in (q, k, v)]
    want = torch.cat([full[:, :, :5], full[:, :, 5:].chunk(4, dim=2)[quarter]], dim=2)
    err = (groups.sequence_attention()(*mine, 5) - want).abs().max().item()
    assert err < 1e-5, f"USP joint attention differs from full attention by {err}"

    groups = build_groups(ParallelDegrees(cfg=2, ulysses=2))
    assert groups.ring is None
    assert dist.get_process_group_ranks(groups.cfg) == [rank % 2, rank % 2 + 2]
    assert dist.get_process_group_ranks(groups.ulysses) == [rank - rank % 2, rank - rank % 2 + 1]
    assert dist.get_process_group_ranks(groups.sequence) == dist.get_process_group_ranks(
        groups.ulysses)


def _perturb(decoder: torch.nn.Module) -> None:
    """Random weights added: the norms and convolutions get real work."""
    with torch.no_grad():
        for p in decoder.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))


def _check_vae_decode(world: int) -> None:
    """A seeded AutoencoderKL (with its mid-block attention) decoded in bands
    over the ranks equals its untiled decode: bands of unequal height
    (5 latent rows) and an image with fewer rows than ranks (decoded whole)."""
    import copy

    from diffusers import AutoencoderKL

    from diffrt.engine.parallel.vae import convert_decoder, parallel_decode

    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4,
                        norm_num_groups=4, layers_per_block=1).eval()
    _perturb(vae.decoder)
    split = copy.deepcopy(vae)
    bands = convert_decoder(split.decoder, dist.group.WORLD)
    for rows in (5, 2 * world, max(1, world - 1)):
        z = _full(rows, (2, 4, rows, 6))
        with torch.no_grad():
            want = vae.decode(z, return_dict=False)[0]
            got = parallel_decode(split, z, bands)
        assert got.shape == want.shape, (got.shape, want.shape)
        err = (got - want).abs().max().item()
        assert err < 1e-4, f"parallel VAE decode ({rows} latent rows) differs by {err}"


def _check_wan_video_vae_decode(world: int) -> None:
    """A seeded ``AutoencoderKLWan`` (the tiny folders' shape: causal 3-D
    convolutions, a temporal upsampler, the mid-block attention) decoded in
    bands of every frame's rows equals its untiled decode: 3 latent frames,
    bands of unequal height (5 latent rows), and fewer rows than ranks."""
    import copy

    from diffusers import AutoencoderKLWan

    from diffrt.engine.models.tiny.wan import TINY_WAN_VAE
    from diffrt.engine.parallel.vae import parallel_decode
    from diffrt.engine.parallel.video_vae import convert_video_decoder

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**TINY_WAN_VAE).eval()
    _perturb(vae.decoder)
    split = copy.deepcopy(vae)
    bands = convert_video_decoder(split.decoder, dist.group.WORLD)
    for rows in (5, max(1, world - 1)):
        z = _full(rows, (1, 16, 3, rows, 4))
        with torch.no_grad():
            want = vae.decode(z, return_dict=False)[0]
            got = parallel_decode(split, z, bands)
        assert got.shape == want.shape, (got.shape, want.shape)
        err = (got - want).abs().max().item()
        assert err < 1e-4, f"parallel Wan VAE decode ({rows} latent rows) differs by {err}"


def _check_wan_video_tokens(world: int) -> None:
    """A seeded tiny ``WanTransformer3DModel`` with its video tokens split
    over the ranks (``pipelines.wan.parallel``), by ring attention and, where
    its 2 heads divide, Ulysses: each rank's output equals the whole forward;
    a clip whose tokens do not divide runs whole."""
    import copy
    import functools

    from diffusers import WanTransformer3DModel

    from diffrt.engine.models.tiny.wan import TINY_WAN_TRANSFORMER
    from diffrt.engine.parallel.attention import joint_ring_attention, joint_ulysses_attention
    from diffrt.engine.parallel.sequence import SequenceSplit
    from diffrt.engine.pipelines.wan.parallel import shard_model

    torch.manual_seed(0)
    model = WanTransformer3DModel(**TINY_WAN_TRANSFORMER).eval()
    text = _full(20, (2, 7, TINY_WAN_TRANSFORMER["text_dim"]))
    timestep = torch.tensor([900.0, 300.0])
    attends = {"ring": functools.partial(joint_ring_attention, group=None)}
    if 2 % world == 0:
        attends["ulysses"] = functools.partial(joint_ulysses_attention, group=None)
    for name, attend in attends.items():
        split_model = copy.deepcopy(model)
        split = SequenceSplit(None, attend)
        shard_model(split_model, split)
        for frames, side in ((3, 8), (1, 6)):  # 48 tokens, then 9 (whole on 2 and 4 ranks)
            x = _full(frames, (2, 16, frames, side, side))
            with torch.no_grad():
                want = model(x, timestep, text, return_dict=False)[0]
                split.begin(frames * (side // 2) ** 2)
                got = split.end(split_model(x, timestep, text, return_dict=False)[0], 1)
            err = (got - want).abs().max().item()
            assert err < 1e-4, f"Wan tokens over {name} ({frames}x{side}^2) differ by {err}"


def _check_wan_image_to_video_split() -> None:
    """tiny-wan-i2v's pipeline (a first frame, CFG, 2 steps: both of Wan
    2.2's experts) on this rank alone, then with CFG parallel over the two
    ranks and the decode in bands over both; the frames within 1/255."""
    import numpy as np
    import PIL.Image

    from diffrt.engine.parallel import ParallelDegrees
    from diffrt.engine.parallel.groups import build_groups
    from diffrt.engine.pipelines import DiffusionRequestBatch, load_pipeline
    from diffrt.engine.postprocess import quantize_images
    from diffrt.engine.request import DiffusionRequest
    from diffrt.engine.sampling import SamplingParams

    pipe = load_pipeline("tiny-wan-i2v")
    first = PIL.Image.fromarray((np.random.default_rng(0).random((64, 64, 3)) * 255)
                                .astype(np.uint8))
    batch = DiffusionRequestBatch([DiffusionRequest(
        prompt="a red fox", negative_prompt="blurry", images=[first],
        sampling_params=SamplingParams(seed=2, num_inference_steps=2))])
    want = quantize_images(pipe.forward(batch)[0]).numpy().astype(np.int16)
    pipe.enable_parallel(build_groups(ParallelDegrees(cfg=2)), vae_parallel=True)
    got = quantize_images(pipe.forward(batch)[0]).numpy().astype(np.int16)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1, \
        f"image-to-video under CFG parallel differs by {np.abs(got - want).max()}/255"
