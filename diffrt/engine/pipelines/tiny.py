"""Tiny seeded components: bit-identical random weights in every process, no download."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def seeded_init(seed: int) -> Iterator[None]:
    """Run module construction with the CPU RNG seeded to ``seed``.

    Modules built inside draw their default initialisation from the seeded
    generator, so every process builds the same weights; the caller's RNG
    state is restored afterwards (no side effect on user sampling).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


#: An 8x AutoencoderKL small enough for CPU tests (shared by tiny-flux and tiny-sd3).
TINY_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    block_out_channels=(32, 32, 64, 64),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    layers_per_block=1,
    norm_num_groups=32,
    sample_size=128,
)
