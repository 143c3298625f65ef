"""GRPO on diffrt-shapes with a LoRA: diffrt rolls out, diffusers + peft train.

The task: draw the shape in **teal** (RGB 0, 200, 200) whatever colour the
prompt names. The shipped model (docs/demo-model.md) never drew teal: its
palette is red, green, blue, yellow, purple and orange, and it draws the
prompt's colour on every held-out prompt. The reward of a picture is how close
its shape's hue is to teal's, at the shape's size (``reward``), a rule on
the pixels, no model.

Each iteration (Flow-GRPO: Liu et al. 2025, and its trainer in
yifan123/flow_grpo, written anew here):

1. **Rollouts from diffrt.** One request per prompt, a group of ``--group``
   outputs with explicit ``seeds=[...]``, ``sampler="flow-sde"``,
   ``return_log_probs=True``, ``return_trajectory=True`` and the LoRA
   adapter ``policy``. The engine step-batches the groups together.
2. **Rewards and advantages**, normalised within each prompt's group.
3. **Gradients from diffusers + peft.** The trainer holds its own copy of the
   model: diffusers' ``FluxTransformer2DModel`` with a peft LoRA. For the
   first ``--train-steps`` denoising steps it recomputes each sample's
   transition log-prob ``log p(x_{k+1} | x_k)`` on the returned trajectory,
   with gradients (the same SDE step, written here from the paper, and the
   same true CFG as the rollout ran), and takes Flow-GRPO's clipped
   objective: ``ratio = exp(new - old)``, loss ``max(-A ratio, -A clip(ratio,
   1 - eps, 1 + eps))``; one optimizer step per minibatch.
4. **``engine.update_lora("policy", factors)``**: the next rollouts run on
   the new adapter (each output says which version in ``lora_versions``).

**Rollouts match training.** The first minibatch of every iteration is
computed before that iteration's first optimizer step, with the very factors
the engine rolled out with, so its recomputed log-probs must equal the ones
diffrt returned (within ``MATCH_ATOL``): the example checks this on every
iteration and stops with an error when they differ (tests/engine/
test_grpo_example.py checks it too). It holds because the engine runs in
float32 here (``dtype="float32"``): a bf16 engine would return bf16
trajectories and log-probs of bf16 arithmetic.

Run from the repository root (about 12 minutes on a 2-core CPU):

    .venv/bin/python examples/grpo_shapes.py --minutes 12 --out grpo-out
    .venv/bin/python examples/grpo_shapes.py --iterations 2 --out /tmp/grpo   # a smoke run

It writes ``OUT/rewards.json`` (the reward per iteration and what the
trainer saw), ``OUT/reward.png`` (the curve: matplotlib, which the
``plot``/``test`` extras install, else drawn with Pillow) and
``OUT/first.png`` / ``OUT/last.png`` (the first and last iteration's
pictures, a row per prompt).
"""

from __future__ import annotations

import argparse
import colorsys
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw

from diffrt.demo.shapes import Scene, render
from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams
from diffrt.engine.models.shipped import shipped_folder

MODEL = "diffrt-shapes"
ADAPTER = "policy"
TARGET = (0, 200, 200)  # teal: not in the model's palette
TARGET_HUE = 180.0  # teal's hue, degrees
#: four prompts, none of them red: red is opposite teal on the hue circle, where
#: turning either way pays the same and the gradient has no direction
SCENES = (Scene("circle", "green", "white", "center"),
          Scene("square", "blue", "black", "top left"),
          Scene("triangle", "purple", "gray", "bottom right"),
          Scene("circle", "yellow", "black", "middle left"))
PROMPTS = tuple(s.prompt for s in SCENES)
CFG = 3.0  # the model's true CFG against "" (docs/demo-model.md), in rollouts and training
NOISE_LEVEL = 0.7  # Flow-GRPO's a
#: the LoRA's target modules (Flow-GRPO's Flux list: attention and feed-forward)
TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
           "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj",
           "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
MATCH_ATOL = 1e-4  # rollouts match training: |diffrt's log-prob - the trainer's|
ADV_CLIP = 5.0  # Flow-GRPO's adv_clip_max


# -- the reward: a rule on the pixels --------------------------------------------------------
def core(image: Image.Image) -> np.ndarray:
    """The shape's pixels, less a 2-pixel rim: what differs from the
    background (the median of the border, as diffrt.demo.shapes.classify
    reads it), eroded twice (a pixel stays when its four neighbours are shape
    too). The rim blends into the background: counting it would pay a blurry
    shape on a background nearer teal than its colour."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.float64)
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
    shape = np.linalg.norm(pixels - np.median(border, axis=0), axis=-1) > 60
    for _ in range(2):
        shape = shape & np.roll(shape, 1, 0) & np.roll(shape, -1, 0) \
            & np.roll(shape, 1, 1) & np.roll(shape, -1, 1)
    return shape


def full_size(prompt: str) -> int:
    """The core's pixels in the prompt's own scene, drawn clean (render)."""
    scene = next(s for s in SCENES if s.prompt == prompt)
    return int(core(render(scene)).sum())


def hue(rgb: np.ndarray) -> float:
    """The hue of an RGB colour in degrees (0 red, 120 green, 240 blue)."""
    return 360 * colorsys.rgb_to_hsv(*(rgb / 255))[0]


def reward(image: Image.Image, full: int) -> float:
    """How teal the shape is: 1 - (hue distance of its core's mean colour to
    teal's 180 degrees) / 180, times min(1, core / (3/4 of ``full``)). Hue,
    not RGB distance: the model draws bigger blobs a little more saturated,
    and an RGB reward paid shrinking them (a first trial did); the size
    factor pays no shape drawn smaller than 3/4 of its size, and no shape
    scores 0 (painting everything teal is not a shape)."""
    shape = core(image)
    if shape.sum() == 0:
        return 0.0
    mean = np.asarray(image.convert("RGB"), dtype=np.float64)[shape].mean(axis=0)
    off = abs(hue(mean) - TARGET_HUE)
    closeness = 1 - min(off, 360 - off) / 180
    return float(closeness * min(1.0, shape.sum() / (0.75 * full)))


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """(prompts, group) rewards -> advantages normalised within each group."""
    mean, std = rewards.mean(dim=1, keepdim=True), rewards.std(dim=1, keepdim=True)
    return ((rewards - mean) / (std + 1e-4)).clamp(-ADV_CLIP, ADV_CLIP)


# -- the SDE step's log-prob, as the trainer computes it (Flow-GRPO, eq. 9) -------------------
def sde_log_prob(x: torch.Tensor, v: torch.Tensor, x_next: torch.Tensor, sigma: float,
                 sigma_next: float, sigma_1: float, noise_level: float) -> torch.Tensor:
    """log N(x_next; mean, std^2) per sample, the per-element mean (Flow-GRPO's
    convention): s = a sqrt(sigma / (1 - sigma)) (sigma_1 in the denominator
    at sigma = 1), mean = x + [v + s^2 / (2 sigma) (x + (1 - sigma) v)] dt,
    std = s sqrt(-dt). Differentiable in ``v``."""
    dt = sigma_next - sigma
    s = noise_level * math.sqrt(sigma / (1 - (sigma_1 if sigma == 1 else sigma)))
    mean = x + (v + s * s / (2 * sigma) * (x + (1 - sigma) * v)) * dt
    std = s * math.sqrt(-dt)
    density = -((x_next - mean) ** 2) / (2 * std * std) - math.log(std) \
        - 0.5 * math.log(2 * math.pi)
    return density.flatten(1).mean(dim=1)


# -- the trainer's model: diffusers' transformer with a peft LoRA -----------------------------
class Policy:
    """diffusers' Flux transformer of the shipped folder with a trainable peft
    LoRA (B starts at zero: the policy starts as the model), and the
    prompts' embeddings (encoded once, as FluxPipeline encodes them)."""

    def __init__(self, prompts: tuple[str, ...], *, rank: int = 8, seed: int = 0) -> None:
        from diffusers import FluxPipeline
        from peft import LoraConfig

        pipe = FluxPipeline.from_pretrained(shipped_folder(MODEL), dtype=torch.float32,
                                            local_files_only=True)
        with torch.no_grad():
            self.embeds, self.pooled, _ = pipe.encode_prompt(list(prompts), None,
                                                             max_sequence_length=16)
            self.neg_embeds, self.neg_pooled, _ = pipe.encode_prompt([""], None,
                                                                     max_sequence_length=16)
        self.pipe_class = FluxPipeline
        self.transformer = pipe.transformer
        self.transformer.requires_grad_(False)
        torch.manual_seed(seed)  # the LoRA's A factors
        self.lora_config = LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian",
                                      target_modules=list(TARGETS))
        self.transformer.add_adapter(self.lora_config)
        self.parameters = [p for p in self.transformer.parameters() if p.requires_grad]

    def factors(self) -> dict[str, torch.Tensor]:
        """The LoRA's tensors named as diffusers saves them (what
        ``engine.update_lora`` and ``add_lora`` read)."""
        from peft.utils import get_peft_model_state_dict

        return {f"transformer.{k}": v.detach().clone().contiguous()
                for k, v in get_peft_model_state_dict(self.transformer).items()}

    def save(self, folder: str) -> str:
        """The adapter as a diffusers LoRA folder (the engine registers it at start)."""
        from peft.utils import get_peft_model_state_dict

        self.pipe_class.save_lora_weights(
            folder, transformer_lora_layers=get_peft_model_state_dict(self.transformer),
            transformer_lora_adapter_metadata=self.lora_config.to_dict())
        return folder

    def log_prob(self, prompt_index: torch.Tensor, x: torch.Tensor, x_next: torch.Tensor,
                 timestep: float, sigma: float, sigma_next: float, sigma_1: float,
                 noise_level: float = NOISE_LEVEL) -> torch.Tensor:
        """Each sample's log p(x_next | x) under the current policy, with
        gradients: x, x_next (B, C, h, w) in the VAE's layout (as diffrt
        returns trajectories), packed as FluxPipeline packs latents; true CFG
        as the rollout ran it: uncond and cond rows in one call."""
        b, c, h, w = x.shape
        pack = self.pipe_class._pack_latents
        latents, nxt = pack(x, b, c, h, w), pack(x_next, b, c, h, w)
        img_ids = self.pipe_class._prepare_latent_image_ids(b, h // 2, w // 2, x.device, x.dtype)
        txt_ids = torch.zeros(self.embeds.shape[1], 3)
        rows = 2 * b
        pred = self.transformer(
            hidden_states=torch.cat([latents, latents]),
            timestep=torch.full((rows,), timestep / 1000),
            guidance=None,
            pooled_projections=torch.cat([self.neg_pooled.expand(b, -1),
                                          self.pooled[prompt_index]]),
            encoder_hidden_states=torch.cat([self.neg_embeds.expand(b, -1, -1),
                                             self.embeds[prompt_index]]),
            txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        uncond, cond = pred.chunk(2)
        v = uncond + CFG * (cond - uncond)
        return sde_log_prob(latents, v, nxt, sigma, sigma_next, sigma_1, noise_level)


# -- rollouts from diffrt ---------------------------------------------------------------------
def make_engine(adapter_folder: str, prompts: tuple[str, ...], **config: Any) -> DiffusionEngine:
    """The rollout engine: step execution, every group in one step batch,
    float32 (so the trainer's float32 recomputation matches), the adapter
    registered as ``policy``."""
    return DiffusionEngine.make_engine(EngineConfig(
        model=MODEL, step_execution=True, max_num_seqs=len(prompts), dtype="float32",
        lora_modules={ADAPTER: adapter_folder}, **config))


@dataclass
class Rollouts:
    """One iteration's samples: ``(prompts, group, ...)`` tensors."""

    images: list[list[Image.Image]]
    log_probs: torch.Tensor  # (P, G, T)
    latents: torch.Tensor  # (P, G, T + 1, C, h, w)
    timesteps: torch.Tensor  # (T,)
    sigmas: torch.Tensor  # (T + 1,)
    lora_versions: list[Any] = field(default_factory=list)


def rollout(engine: DiffusionEngine, prompts: tuple[str, ...], seeds: list[list[int]],
            steps: int | None = None) -> Rollouts:
    """One flow-sde request per prompt, a group of outputs with explicit seeds."""
    outs = engine.generate([DiffusionRequest(prompt=p, sampling_params=SamplingParams(
        num_outputs_per_prompt=len(group), seeds=group, num_inference_steps=steps,
        sampler="flow-sde", noise_level=NOISE_LEVEL, loras={ADAPTER: 1.0},
        return_log_probs=True, return_trajectory=True)) for p, group in zip(prompts, seeds,
                                                                              strict=True)])
    failed = [o.error for o in outs if not o.ok]
    if failed:
        raise RuntimeError(f"rollout failed: {failed[0]}")
    rolls = [o.rollout for o in outs]
    return Rollouts(images=[list(o.images) for o in outs],
                    log_probs=torch.stack([r.log_probs for r in rolls]),
                    latents=torch.stack([r.latents for r in rolls]),
                    timesteps=rolls[0].timesteps, sigmas=rolls[0].sigmas,
                    lora_versions=[o.lora_versions.get(ADAPTER) for o in outs])


# -- one GRPO update -------------------------------------------------------------------------
@dataclass
class TrainStats:
    #: max |trainer's log-prob - diffrt's| of the first minibatch (before any update)
    match_gap: float
    clipfrac: float
    approx_kl: float
    loss: float


def train(policy: Policy, optimizer: torch.optim.Optimizer, rolls: Rollouts,
          advantages: torch.Tensor, *, train_steps: int, minibatches: int, clip_range: float,
          generator: torch.Generator) -> TrainStats:
    """Flow-GRPO's update on one iteration's samples: shuffled into
    minibatches; for each, the first ``train_steps`` steps' log-probs
    recomputed with gradients, the clipped objective accumulated over the
    steps, one optimizer step. Raises when the first minibatch's log-probs
    (computed before this iteration's first update) do not equal diffrt's."""
    p, g, t = rolls.log_probs.shape
    steps = min(train_steps, t)
    prompt_index = torch.arange(p).repeat_interleave(g)
    old = rolls.log_probs.reshape(p * g, t)
    latents = rolls.latents.reshape(p * g, *rolls.latents.shape[2:])
    adv = advantages.reshape(p * g)
    sigmas = [float(s) for s in rolls.sigmas]
    order = torch.randperm(p * g, generator=generator)
    gap, clipped, kl, losses = 0.0, [], [], []
    for m, rows in enumerate(order.chunk(minibatches)):
        for k in range(steps):
            new = policy.log_prob(prompt_index[rows], latents[rows, k], latents[rows, k + 1],
                                  float(rolls.timesteps[k]), sigmas[k], sigmas[k + 1], sigmas[1])
            if m == 0:  # rollouts match training
                gap = max(gap, float((new.detach() - old[rows, k]).abs().max()))
            ratio = torch.exp(new - old[rows, k])
            a = adv[rows]
            loss = torch.maximum(-a * ratio,
                                 -a * ratio.clamp(1 - clip_range, 1 + clip_range)).mean()
            (loss / steps).backward()
            losses.append(float(loss.detach()))
            clipped.append(float(((ratio.detach() - 1).abs() > clip_range).float().mean()))
            kl.append(float(0.5 * ((new.detach() - old[rows, k]) ** 2).mean()))
        if m == 0 and gap > MATCH_ATOL:
            raise AssertionError(
                f"rollouts do not match training: the trainer's log-probs differ from diffrt's "
                f"by {gap:.2e} (> {MATCH_ATOL}) before any update of this iteration")
        torch.nn.utils.clip_grad_norm_(policy.parameters, 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return TrainStats(gap, float(np.mean(clipped)), float(np.mean(kl)), float(np.mean(losses)))


# -- outputs: the curve and the pictures -----------------------------------------------------
def plot(history: list[dict[str, Any]], path: str) -> str:
    """The mean reward per iteration (a band of the mean within-group std)
    and each prompt's: matplotlib
    where installed, else Pillow. Returns which drew it."""
    xs = [h["iteration"] for h in history]
    ys = [h["reward"] for h in history]
    sd = [h["reward_group_std"] for h in history]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _plot_pillow(xs, ys, path)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    per_prompt = list(zip(*(h["reward_per_prompt"] for h in history), strict=True))
    for i, rewards in enumerate(per_prompt):
        ax.plot(xs, rewards, color="gray", linewidth=0.6, alpha=0.6,
                label="per prompt" if i == 0 else None)
    ax.plot(xs, ys, marker=".", color="teal", label="mean reward")
    ax.fill_between(xs, [y - s for y, s in zip(ys, sd, strict=True)],
                    [y + s for y, s in zip(ys, sd, strict=True)], color="teal", alpha=0.15,
                    label="± std within a group")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward (shape's closeness to teal)")
    ax.set_title("GRPO on diffrt-shapes with a LoRA: rollouts from diffrt")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return "matplotlib"


def _plot_pillow(xs: list[int], ys: list[float], path: str) -> str:
    w, h, pad = 640, 360, 40
    image = Image.new("RGB", (w, h), "white")
    draw = ImageDraw.Draw(image)
    lo, hi = min(ys), max(ys)
    span, last = (hi - lo) or 1.0, max(xs[-1], 1)
    points = [(pad + (w - 2 * pad) * x / last, h - pad - (h - 2 * pad) * (y - lo) / span)
              for x, y in zip(xs, ys, strict=True)]
    draw.rectangle((pad, pad, w - pad, h - pad), outline="gray")
    if len(points) > 1:
        draw.line(points, fill=(0, 128, 128), width=2)
    draw.text((pad, 10), f"mean reward per iteration: {lo:.3f} .. {hi:.3f}", fill="black")
    image.save(path)
    return "pillow"


def grid(images: list[list[Image.Image]], path: str) -> None:
    side = images[0][0].width
    sheet = Image.new("RGB", (side * len(images[0]), side * len(images)), "white")
    for r, row in enumerate(images):
        for c, image in enumerate(row):
            sheet.paste(image, (c * side, r * side))
    sheet.save(path)


# -- one iteration ---------------------------------------------------------------------------
def iteration(engine: DiffusionEngine, policy: Policy, optimizer: torch.optim.Optimizer,
              prompts: tuple[str, ...], seeds: list[list[int]], args: argparse.Namespace,
              shuffle: torch.Generator) -> tuple[dict[str, Any], Rollouts]:
    """Roll out on the engine's current adapter, score, train, and send the
    new factors (``update_lora``); returns what it saw and the rollouts."""
    began = time.perf_counter()
    sent = next(a.version for a in engine.list_loras() if a.name == ADAPTER)
    rolls = rollout(engine, prompts, seeds, args.steps)
    if any(v != sent for v in rolls.lora_versions):
        raise AssertionError(f"rolled out on adapter versions {rolls.lora_versions}, not {sent}")
    rolled = time.perf_counter()
    rewards = torch.tensor([[reward(im, full_size(p)) for im in row]
                            for p, row in zip(prompts, rolls.images, strict=True)])
    stats = train(policy, optimizer, rolls, group_advantages(rewards),
                  train_steps=args.train_steps, minibatches=args.minibatches,
                  clip_range=args.clip_range, generator=shuffle)
    trained = time.perf_counter()
    version = engine.update_lora(ADAPTER, policy.factors()).version
    return {"reward": float(rewards.mean()),
            "reward_group_std": float(rewards.std(dim=1).mean()),
            "reward_per_prompt": [float(r) for r in rewards.mean(dim=1)],
            "match_gap": stats.match_gap, "clipfrac": stats.clipfrac,
            "approx_kl": stats.approx_kl, "loss": stats.loss, "rolled_on": sent,
            "lora_version": version, "rollout_s": rolled - began,
            "train_s": trained - rolled, "update_s": time.perf_counter() - trained}, rolls


# -- the loop --------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=12.0,
                    help="start no iteration that would end past this many minutes")
    ap.add_argument("--iterations", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="grpo-out")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), choices=range(1, len(PROMPTS) + 1))
    ap.add_argument("--group", type=int, default=8, help="outputs (seeds) per prompt")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (the model's 12)")
    ap.add_argument("--train-steps", type=int, default=8,
                    help="train on the first K steps of each trajectory (where the colour "
                         "is decided)")
    ap.add_argument("--minibatches", type=int, default=4,
                    help="optimizer steps per iteration, each on a share of the samples (the "
                         "later shares' ratios drift from 1: the clip bounds them)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--clip-range", type=float, default=1e-3)
    args = ap.parse_args(argv)
    if args.iterations < 1 or args.group < 2:
        ap.error("--iterations must be at least 1 and --group at least 2 (a group's "
                 "advantages are relative)")
    start = time.perf_counter()
    prompts = PROMPTS[:args.prompts]
    os.makedirs(args.out, exist_ok=True)
    policy = Policy(prompts, rank=args.rank, seed=args.seed)
    optimizer = torch.optim.AdamW(policy.parameters, lr=args.lr, weight_decay=1e-4)
    shuffle = torch.Generator().manual_seed(args.seed)
    history: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="grpo-shapes-") as work:
        engine = make_engine(policy.save(os.path.join(work, "adapter")), prompts)
        print(f"engine ready in {time.perf_counter() - start:.1f} s; {len(prompts)} prompts x "
              f"{args.group} seeds, training the first {args.train_steps} steps", flush=True)
        last_s = 0.0
        try:
            for it in range(args.iterations):
                elapsed = time.perf_counter() - start
                if it and elapsed + last_s > args.minutes * 60:
                    break
                seeds = [[args.seed * 1_000_003 + (it * len(prompts) + p) * args.group + i
                          for i in range(args.group)] for p in range(len(prompts))]
                record, rolls = iteration(engine, policy, optimizer, prompts, seeds, args,
                                          shuffle)
                record.update(iteration=it, elapsed_s=time.perf_counter() - start)
                history.append(record)
                last_s = record["rollout_s"] + record["train_s"] + record["update_s"]
                print(f"iter {it:3d}  reward {record['reward']:.4f} (group std "
                      f"{record['reward_group_std']:.4f})"
                      f"  match {record['match_gap']:.1e}  clipfrac {record['clipfrac']:.2f}  "
                      f"rollout {record['rollout_s']:.1f} s  train {record['train_s']:.1f} s",
                      flush=True)
                if it == 0:
                    grid(rolls.images, os.path.join(args.out, "first.png"))
            grid(rolls.images, os.path.join(args.out, "last.png"))
        finally:
            engine.close()
    with open(os.path.join(args.out, "rewards.json"), "w") as f:
        json.dump({"model": MODEL, "prompts": list(prompts), "target_rgb": list(TARGET),
                   "args": vars(args), "iterations": history}, f, indent=1)
    drew = plot(history, os.path.join(args.out, "reward.png"))
    ends = min(3, len(history))
    first = float(np.mean([h["reward"] for h in history[:ends]]))
    last = float(np.mean([h["reward"] for h in history[-ends:]]))
    print(f"{len(history)} iterations in {time.perf_counter() - start:.0f} s: mean reward of "
          f"the first {ends} {first:.4f}, of the last {ends} {last:.4f}; wrote {args.out}/rewards.json, reward.png ({drew}), "
          f"first.png, last.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
