"""Rollouts in the denoise loop: Flow-GRPO's SDE step, per-output noise, and
what a request records of its steps (log-probs, trajectory).

The flow-matching ODE step is ``x' = x + v dt`` (``dt = sigma' - sigma < 0``,
``v`` the model's velocity). Flow-GRPO (Liu et al. 2025, "Flow-GRPO: Training
Flow Matching Models via Online RL", eq. 9; its reference code is
``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py`` in yifan123/flow_grpo)
turns it into an SDE with the same marginals, so each step is a Gaussian
transition whose log-density a policy gradient needs::

    s_t  = a * sqrt(sigma / (1 - sigma))          (sigma = 1: sigma_1 in the denominator)
    mean = x * (1 + s_t^2 / (2 sigma) * dt) + v * (1 + s_t^2 (1 - sigma) / (2 sigma)) * dt
    x'   = mean + s_t * sqrt(-dt) * eps,  eps ~ N(0, I)
    log p(x' | x) = mean over elements of  -(x' - mean)^2 / (2 std^2) - log std - log sqrt(2 pi),
                    std = s_t * sqrt(-dt)

As in the reference, the log-prob is the per-element mean (not the sum) and
the step is computed in float32; unlike it, the log-prob is that of ``x'`` as
stored (cast to the latents' dtype), so a trainer that recomputes it from the
returned trajectory gets the same number. The noise ``eps`` is drawn from the
request's own CPU generators (one per output when it gave ``seeds``), in the
VAE's latent layout, so it does not depend on the device or on batch mates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from diffrt.engine.sampling import SamplingParams, filled

if TYPE_CHECKING:
    from diffrt.engine.pipelines.latents import SpatialLatents

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def noise_generators(params: SamplingParams, seed: int) -> list[tuple[torch.Generator, int]]:
    """The CPU generators a request draws its noise from, each with the rows
    (outputs) it draws for: one per output when it gave ``seeds``, else one
    seeded by ``seed`` for all its outputs (what diffrt always did)."""
    if params.seeds is not None:
        return [(torch.Generator(device="cpu").manual_seed(int(s)), 1) for s in params.seeds]
    return [(torch.Generator(device="cpu").manual_seed(seed), params.num_outputs_per_prompt)]


def draw_noise(layout: SpatialLatents, params: SamplingParams,
               generators: list[tuple[torch.Generator, int]]) -> torch.Tensor:
    """Standard normal noise for every output, (n, C, *size) float32 on the
    CPU in the VAE's layout, each generator drawing its own rows."""
    parts = [layout.noise(msgspec.structs.replace(params, num_outputs_per_prompt=rows), gen)
             for gen, rows in generators]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def sde_std(sigmas: torch.Tensor, index: int, noise_level: float) -> float:
    """Flow-GRPO's ``s_t`` at schedule index ``index`` (sigma = 1 borrows
    ``sigmas[1]`` for the denominator, as the reference does)."""
    sigma = float(sigmas[index])
    denominator = 1 - (float(sigmas[1]) if sigma == 1 else sigma)
    return math.sqrt(sigma / denominator) * noise_level


def sde_step(latents: torch.Tensor, velocity: torch.Tensor, sigma: float, sigma_next: float,
             std_t: float, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One SDE step of every row: (x' in the latents' dtype, each row's
    log-prob of it, float32 (rows,)). ``noise`` is eps in the latents' layout."""
    dt = sigma_next - sigma
    x, v = latents.float(), velocity.float()
    mean = (x * (1 + std_t ** 2 / (2 * sigma) * dt)
            + v * ((1 + std_t ** 2 * (1 - sigma) / (2 * sigma)) * dt))
    std = std_t * math.sqrt(-dt)
    nxt = (mean + std * noise.to(device=mean.device, dtype=torch.float32)).to(latents.dtype)
    log_prob = (-((nxt.float() - mean) ** 2) / (2 * std ** 2)
                - math.log(std) - _LOG_SQRT_2PI)
    return nxt, log_prob.mean(dim=tuple(range(1, log_prob.dim())))


@dataclass
class RowNoise:
    """One request's rollout state in the worker (``StepRequestState.rollout``):
    its generators (the SDE draws from them after the first latents), and
    what it records of its steps."""

    generators: list[tuple[torch.Generator, int]]
    #: flow-sde's noise level (None: the default sampler, no draws after the first)
    noise_level: float | None
    keep_log_probs: bool
    keep_trajectory: bool
    #: each step's (rows,) log-probs, and the latents before the first step
    #: and after each (the VAE's layout), as recorded
    log_probs: list[torch.Tensor] = field(default_factory=list)
    trajectory: list[torch.Tensor] = field(default_factory=list)
    #: the schedule's timesteps and sigmas of the steps it ran
    timesteps: torch.Tensor | None = None
    sigmas: torch.Tensor | None = None

    @classmethod
    def of(cls, params: SamplingParams, seed: int) -> RowNoise:
        return cls(noise_generators(params, seed),
                   params.effective_noise_level if params.sampler == "flow-sde" else None,
                   params.return_log_probs, params.return_trajectory)

    @property
    def wanted(self) -> bool:
        """The request asked for something beside its images."""
        return self.keep_log_probs or self.keep_trajectory

    def record(self, latents: torch.Tensor, unpack: Any) -> None:
        """Keep ``latents`` (the transformer's layout) in the trajectory, in
        the VAE's layout (``unpack``), as its own copy."""
        if self.keep_trajectory:
            self.trajectory.append(unpack(latents).clone())

    def step(self, layout: SpatialLatents, params: SamplingParams, sigmas: torch.Tensor,
             index: int, latents: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
        """flow-sde's step at schedule index ``index``: fresh noise from the
        generators, the next latents, and the step's log-probs kept."""
        assert self.noise_level is not None
        noise = layout.pack(draw_noise(layout, params, self.generators))
        nxt, log_prob = sde_step(latents, velocity, float(sigmas[index]), float(sigmas[index + 1]),
                                 sde_std(sigmas, index, self.noise_level), noise)
        if self.keep_log_probs:
            self.log_probs.append(log_prob)
        return nxt

    def result(self) -> dict[str, torch.Tensor]:
        """What travels beside the images (``outputs.Rollout``'s fields)."""
        out: dict[str, torch.Tensor] = {"timesteps": filled(self.timesteps).float(),
                                        "sigmas": filled(self.sigmas).float()}
        if self.keep_log_probs:
            out["log_probs"] = torch.stack(self.log_probs, dim=1)
        if self.keep_trajectory:
            out["latents"] = torch.stack(self.trajectory, dim=1)
        return out


__all__ = ["RowNoise", "draw_noise", "noise_generators", "sde_std", "sde_step"]
