"""Train the demo model ``diffrt-shapes``: a tiny Flux that draws what its prompt says.

    .venv/bin/python scripts/train_demo_model.py --out diffrt/models/diffrt-shapes
    .venv/bin/python scripts/train_demo_model.py --out /tmp/shapes --minutes 3   # a quick trial

Seeded (data, weights, batches) and bounded by the clock by default: 15 % of
``--minutes`` trains the VAE, the rest the transformer with both text
encoders, then the folder is written in float16 and evaluated. A clock-bounded
run takes as many steps as the machine manages, so it is not repeatable to
the bit; ``--vae-steps N --steps M`` bound both phases by steps instead
(learning-rate schedule by step too): the same torch build and thread count
then give the same folder. The shipped folder is a 30-minute clock-bounded
run (about 2300 VAE steps, 3158 transformer steps on 2 cores). Not run by CI.

1. Data (``diffrt.demo.shapes``): 64x64 pictures of one shape (3 shapes x 6
   colours x 9 backgrounds x 9 places), jittered and resized a little; the
   held-out 11 % of combinations are never seen.
2. VAE: a small diffusers ``AutoencoderKL`` with 2x downsampling (64x64x3 ->
   32x32x4, no mid-block attention), trained on reconstruction (L1 + MSE, a
   tiny KL); its latents' mean and spread become ``shift_factor`` and
   ``scaling_factor``. 2x, not the usual 8x: FluxPipeline packs 2x2 latent
   patches into one token, so the 64x64 picture becomes 16x16 tokens and a
   shape spans about five of them (with a 4x VAE, 8x8 tokens, the transformer
   blurred squares into circles). The training pictures' latents are then
   encoded once into a cache the transformer's batches are drawn from.
3. Transformer + text encoders: a 2+2-block ``FluxTransformer2DModel``
   (hidden 128), a CLIP and a T5 encoder, trained jointly from scratch with
   the rectified-flow loss ``FlowMatchEulerDiscreteScheduler`` samples
   (``x_t = (1 - s) x0 + s noise``, target ``noise - x0``, logit-normal
   ``s``), prompts encoded exactly as diffusers' ``FluxPipeline`` encodes
   them (CLIP pooled output, T5 last hidden states, both padded to 16
   tokens: the folder's tokenizers say so, and ``max_sequence_length=16``
   must be passed to diffusers), 10 % empty prompts.
4. Evaluation: held-out prompts at 12 steps through diffusers' FluxPipeline
   loaded from the written folder; the deterministic classifier of
   ``diffrt.demo.shapes`` reads colour, shape, position and background; the
   table goes into the folder's model card.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from diffrt.demo import shapes
from diffrt.engine.models.tiny.shared import (
    FLUX_COMPONENTS,
    _write_index,
    build_clip_tokenizer,
    build_t5_tokenizer,
    seeded_init,
)

TEXT_TOKENS = 16
VAE = dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 32),
           down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
           layers_per_block=1, norm_num_groups=8, sample_size=64, use_quant_conv=False,
           use_post_quant_conv=False, mid_block_add_attention=False)
#: renders of each training scene in the transformer's latent cache (jittered, resized)
VARIANTS = 12
CLIP = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=TEXT_TOKENS, projection_dim=64, hidden_act="quick_gelu")
T5 = dict(d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2,
          relative_attention_num_buckets=8, relative_attention_max_distance=16,
          feed_forward_proj="gated-gelu", dropout_rate=0.0)
TRANSFORMER = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                   attention_head_dim=32, num_attention_heads=4, joint_attention_dim=64,
                   pooled_projection_dim=64, axes_dims_rope=(8, 12, 12), guidance_embeds=False)
#: noise-level shift of training and sampling (SD3's time shift): 256 latent
#: tokens carry enough signal in aggregate that, unshifted, the layout (where
#: the shape goes, which colour) is decided at noise levels training rarely
#: visits; shifted, training and the 12 sampling steps both dwell there
SHIFT = 3.0
SCHEDULER = dict(num_train_timesteps=1000, shift=SHIFT, use_dynamic_shifting=False)
WARMUP_STEPS = 100
#: extra loss weight of the tokens on and around the shape (see token_weights)
SHAPE_WEIGHT = 4.0
EVAL_STEPS = 12
#: true CFG scales the evaluation measures (the first is diffrt's default for the model)
CFG_SCALES = (3.0, 1.0)


def words() -> tuple[str, ...]:
    return tuple(dict.fromkeys(w for s in shapes.all_scenes() for w in s.prompt.split()))


def pictures(scenes: list[shapes.Scene], rng: np.random.Generator) -> torch.Tensor:
    """(N, 3, 64, 64) in [-1, 1]."""
    arrays = [np.asarray(shapes.random_render(s, rng), dtype=np.float32) for s in scenes]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2) / 127.5 - 1.0


class Budget:
    """When a training phase ends: after ``steps`` steps when given (a run
    that repeats exactly), else after ``seconds`` of wall clock."""

    def __init__(self, seconds: float, steps: int | None):
        self.seconds, self.steps, self.start = seconds, steps, time.monotonic()

    def progress(self, step: int) -> float:
        """How much of the phase is done, 0..1 (drives the learning rate)."""
        if self.steps:
            return min(1.0, step / self.steps)
        return min(1.0, (time.monotonic() - self.start) / self.seconds)

    def over(self, step: int) -> bool:
        return self.progress(step) >= 1.0


def train_vae(budget: Budget, rng: np.random.Generator, log: callable,
              latent_channels: int) -> torch.nn.Module:
    from diffusers import AutoencoderKL

    with seeded_init(1):
        vae = AutoencoderKL(**{**VAE, "latent_channels": latent_channels})
    optimiser = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    step = 0
    while not budget.over(step):
        batch = pictures([shapes.TRAIN[i] for i in rng.integers(len(shapes.TRAIN), size=16)], rng)
        posterior = vae.encode(batch).latent_dist
        recon = vae.decode(posterior.sample()).sample
        kl = posterior.kl().mean() / (64 * 64 * 3)
        loss = F.l1_loss(recon, batch) + F.mse_loss(recon, batch) + 1e-4 * kl
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        step += 1
        if step % 200 == 0:
            log(f"vae step {step}: loss {loss.item():.4f}")
    return vae.eval()


def latent_cache(vae: torch.nn.Module, rng: np.random.Generator
                 ) -> tuple[list[shapes.Scene], torch.Tensor, torch.Tensor]:
    """VARIANTS renders of every training scene, encoded once (the VAE's mode,
    unscaled), and each one's token weights: the transformer's batches are
    drawn from here, so its steps do not pay for the VAE's encoder."""
    scenes = [s for s in shapes.TRAIN for _ in range(VARIANTS)]
    latents, weights = [], []
    with torch.no_grad():
        for i in range(0, len(scenes), 256):
            batch = pictures(scenes[i:i + 256], rng)
            latents.append(vae.encode(batch).latent_dist.mode())
            weights.append(token_weights(batch, scenes[i:i + 256]))
    return scenes, torch.cat(latents), torch.cat(weights)


def token_weights(batch: torch.Tensor, scenes: list[shapes.Scene]) -> torch.Tensor:
    """(N, tokens): 1 + SHAPE_WEIGHT on the tokens that hold the shape or
    touch its outline. Three quarters of a picture is flat background, easy
    to predict and uninformative; weighted this way about half of the loss
    is where circles, squares and triangles differ."""
    backgrounds = torch.tensor([shapes.PALETTE[s.background] for s in scenes],
                               dtype=torch.float32)[:, :, None, None] / 127.5 - 1.0
    shape = ((batch - backgrounds).abs().amax(1, keepdim=True) > 0.1).float()
    tokens = F.max_pool2d(shape, 4)  # 4x4 pixels per token (2x VAE, 2x2 packing)
    tokens = F.max_pool2d(tokens, 3, stride=1, padding=1)  # and the outline's neighbours
    return 1.0 + SHAPE_WEIGHT * tokens.flatten(1)


def reconstruction_accuracy(vae: torch.nn.Module, rng: np.random.Generator) -> str:
    """The classifier on the VAE's reconstructions of held-out pictures: what
    the transformer can reach at best."""
    scenes = shapes.HELD_OUT[::3]
    with torch.no_grad():
        recon = vae.decode(vae.encode(pictures(scenes, rng)).latent_dist.mode()).sample
    hits = shapes.tally(scenes, list(to_pixels(recon)))
    return ", ".join(f"{k} {v / len(scenes):.0%}" for k, v in hits.items())


def to_pixels(images: torch.Tensor) -> np.ndarray:
    """(N, 3, H, W) in [-1, 1] -> (N, H, W, 3) uint8, as diffusers' image processor rounds."""
    return ((images.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()


def shifted(sigma: torch.Tensor) -> torch.Tensor:
    """The scheduler's static shift, as FlowMatchEulerDiscreteScheduler applies it."""
    return SHIFT * sigma / (1 + (SHIFT - 1) * sigma)


def layout_probe(vae, transformer, tokenizers, encoders, ids, txt_ids,
                 token_shape: tuple[int, int]) -> callable:
    """A progress check that costs a second: from pure noise, one prediction
    of the clean picture for 30 held-out prompts, read back by the
    classifier. The first sampling step decides the layout, so this shows
    whether the model has learnt to put the right colour in the right place
    long before the final evaluation."""
    scenes = shapes.HELD_OUT[::5]
    prompts = [s.prompt for s in scenes]
    noise = torch.randn(len(scenes), *token_shape, generator=torch.Generator().manual_seed(0))
    scale, shift = vae.config.scaling_factor, vae.config.shift_factor

    def run(step: int) -> str:
        with torch.no_grad():
            embeds, pooled = encode_prompts(tokenizers, encoders, prompts)
            v = transformer(hidden_states=noise, encoder_hidden_states=embeds,
                            pooled_projections=pooled, timestep=torch.ones(len(scenes)),
                            img_ids=ids, txt_ids=txt_ids, guidance=None, return_dict=False)[0]
            latents = unpack(noise - v, shapes.SIZE // 2) / scale + shift
            images = vae.decode(latents).sample
        hits = shapes.tally(scenes, list(to_pixels(images)))
        return "one step from noise reads back " + ", ".join(  # the shape is still a blur
            f"{k} {hits[k] / len(scenes):.0%}" for k in ("colour", "position", "background"))

    return run


def encode_prompts(tokenizers, encoders, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """As FluxPipeline.encode_prompt (CLIP pooled output, T5 last hidden state)."""
    clip_tok, t5_tok = tokenizers
    clip, t5 = encoders
    ids = clip_tok(prompts, padding="max_length", max_length=clip_tok.model_max_length,
                   truncation=True, return_tensors="pt").input_ids
    pooled = clip(ids, output_hidden_states=False).pooler_output
    ids2 = t5_tok(prompts, padding="max_length", max_length=TEXT_TOKENS, truncation=True,
                  return_tensors="pt").input_ids
    return t5(ids2, output_hidden_states=False)[0], pooled


def pack(latents: torch.Tensor) -> torch.Tensor:
    n, c, h, w = latents.shape
    latents = latents.view(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(n, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, side: int) -> torch.Tensor:
    """pack's inverse: (N, tokens, 4C) -> (N, C, side, side) latents."""
    n, _, c4 = tokens.shape
    latents = tokens.view(n, side // 2, side // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(n, c4 // 4, side, side)


def image_ids(h: int, w: int) -> torch.Tensor:
    ids = torch.zeros(h, w, 3)
    ids[..., 1] += torch.arange(h)[:, None]
    ids[..., 2] += torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder to write")
    ap.add_argument("--minutes", type=float, default=30.0,
                    help="wall-clock budget of the whole run (default: %(default)s)")
    ap.add_argument("--vae-steps", type=int, default=None,
                    help="train the VAE this many steps instead of its share of --minutes")
    ap.add_argument("--steps", type=int, default=None,
                    help="train the transformer this many steps instead of the rest of "
                         "--minutes (with --vae-steps: a run that repeats to the bit)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--latent-channels", type=int, default=4,
                    help="VAE latent channels (the transformer takes 4x as many)")
    ap.add_argument("--vae-share", type=float, default=0.15,
                    help="share of --minutes that trains the VAE")
    ap.add_argument("--batch", type=int, default=32, help="transformer batch size")
    ap.add_argument("--lr", type=float, default=1e-3, help="transformer peak learning rate")
    ap.add_argument("--evaluate-only", action="store_true",
                    help="measure the folder --out again and rewrite its evaluation.json and "
                         "model card (its training record kept)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    out = Path(args.out)
    began = time.monotonic()

    def log(text: str) -> None:
        print(f"[{(time.monotonic() - began) / 60:5.1f} min] {text}", flush=True)

    if args.evaluate_only:
        training = json.loads((out / "evaluation.json").read_text(encoding="utf-8"))["training"]
        record(out, {**evaluate(out, log), "training": training})
        return 0

    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    budget = args.minutes * 60
    vae = train_vae(Budget(budget * args.vae_share, args.vae_steps), rng, log,
                    args.latent_channels)
    log(f"vae done; its reconstructions of held-out pictures read back: "
        f"{reconstruction_accuracy(vae, rng)}")
    cache_scenes, cache, cache_weights = latent_cache(vae, rng)
    # the latents' statistics set diffusers' scaling: latent = (z - shift) * scale
    shift, scale = float(cache.mean()), float(1.0 / cache.std())
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    cache = pack((cache - shift) * scale)
    log(f"latent cache: {len(cache_scenes)} pictures, shift {shift:.4f}, scale {scale:.4f}")

    out.mkdir(parents=True, exist_ok=True)
    clip_tok = build_clip_tokenizer(out / "tokenizer", extra=words(), max_length=TEXT_TOKENS)
    t5_tok = build_t5_tokenizer(out / "tokenizer_2", extra=words(), max_length=TEXT_TOKENS)
    vocab = clip_tok.get_vocab()
    with seeded_init(2):
        clip = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(vocab), bos_token_id=vocab["<|startoftext|>"],
            eos_token_id=vocab["<|endoftext|>"], pad_token_id=vocab["<|endoftext|>"], **CLIP))
    with seeded_init(3):
        t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), pad_token_id=0, eos_token_id=1,
                                     decoder_start_token_id=0, is_encoder_decoder=False, **T5))
    with seeded_init(4):
        transformer = FluxTransformer2DModel(**{**TRANSFORMER,
                                                "in_channels": 4 * args.latent_channels})
    params = [*transformer.parameters(), *clip.parameters(), *t5.parameters()]
    optimiser = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    ids = image_ids(shapes.SIZE // 4, shapes.SIZE // 4)  # 2x VAE, then 2x2 packing
    txt_ids = torch.zeros(TEXT_TOKENS, 3)
    probe = layout_probe(vae, transformer, (clip_tok, t5_tok), (clip, t5), ids, txt_ids,
                         tuple(cache.shape[1:]))
    step, losses = 0, []
    # what is left, less time for the evaluation
    phase = Budget(budget * 0.95 - (time.monotonic() - began), args.steps)
    for module in (transformer, clip, t5):
        module.train()
    while not phase.over(step):
        picks = rng.integers(len(cache_scenes), size=args.batch)
        prompts = ["" if rng.random() < 0.1 else cache_scenes[i].prompt for i in picks]
        x0 = cache[torch.from_numpy(picks)]
        weights = cache_weights[torch.from_numpy(picks)]
        noise = torch.randn_like(x0)
        sigma = shifted(torch.sigmoid(torch.randn(args.batch)))[:, None, None]
        xt = (1 - sigma) * x0 + sigma * noise
        embeds, pooled = encode_prompts((clip_tok, t5_tok), (clip, t5), prompts)
        pred = transformer(hidden_states=xt, encoder_hidden_states=embeds,
                           pooled_projections=pooled, timestep=sigma.view(-1), img_ids=ids,
                           txt_ids=txt_ids, guidance=None, return_dict=False)[0]
        loss = (((pred - (noise - x0)) ** 2).mean(-1) * weights).sum() / weights.sum()
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        done = phase.progress(step)
        for group in optimiser.param_groups:  # warm-up, then a cosine decay over the budget
            group["lr"] = args.lr * min(1.0, (step + 1) / WARMUP_STEPS) * 0.5 * (
                1 + math.cos(math.pi * min(1.0, done)))
        optimiser.step()
        losses.append(loss.item())
        step += 1
        if step % 50 == 0:
            log(f"step {step}: loss {np.mean(losses[-50:]):.4f}")
        if step % 500 == 0 or step == 1:
            log(f"step {step}: {probe(step)}")

    half = torch.float16
    for module, name in ((transformer, "transformer"), (vae, "vae"), (clip, "text_encoder"),
                         (t5, "text_encoder_2")):
        module.eval().to(half).save_pretrained(out / name, safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(**SCHEDULER).save_pretrained(out / "scheduler")
    _write_index(out, "FluxPipeline", FLUX_COMPONENTS)
    log(f"wrote {out} after {step} steps (last loss {np.mean(losses[-50:]):.4f})")
    table = evaluate(out, log)
    table["training"] = {"minutes": args.minutes, "seed": args.seed, "steps": step,
                         "latent_channels": args.latent_channels, "vae_share": args.vae_share,
                         "batch": args.batch, "lr": args.lr, "threads": torch.get_num_threads(),
                         "vae_steps_bound": args.vae_steps, "steps_bound": args.steps,
                         "final_loss": round(float(np.mean(losses[-50:])), 4)}
    record(out, table)
    return 0


def record(out: Path, table: dict) -> None:
    """evaluation.json and the model card of the folder."""
    (out / "evaluation.json").write_text(json.dumps(table, indent=2) + "\n", encoding="utf-8")
    write_model_card(out, table)


def write_model_card(out: Path, table: dict) -> None:
    """The folder's README.md: what it is, what it was trained on, how to
    retrain it, how to load it, what it measures."""
    acc = "\n".join(
        f"| {row['true_cfg_scale']:g}{' (default)' if row['true_cfg_scale'] == CFG_SCALES[0] else ''} | "
        + " | ".join(f"{row[k]:.0%}" for k in shapes.ATTRIBUTES) + " |"
        for row in table["rows"])
    train = table.get("training", {})
    (out / "README.md").write_text(f"""---
library_name: diffusers
pipeline_tag: text-to-image
---
# diffrt-shapes

A tiny text-to-image model in diffusers' FLUX.1 layout (`FluxPipeline`), trained from scratch
on synthetic 64x64 pictures of one shape: "a red circle on a yellow background in the top
left". It is diffrt's default model: a first `diffrt generate` shows that the runtime draws
what the prompt asks for, and tests can check pictures by their content.

- Vocabulary: 3 shapes (circle, square, triangle) x 6 colours (red, green, blue, yellow,
  purple, orange) x 9 backgrounds (white, black, gray and the six colours; never the shape's)
  x 9 places (top/middle/bottom x left/middle/right; "center"); prompts are
  `a <colour> <shape> on a <background> background in the <place>`. 11 % of the
  combinations (146 of 1296) were held out of training.
- Components: `AutoencoderKL` (2x downsampling, {train.get('latent_channels', 4)} latent channels), a 2+2-block
  `FluxTransformer2DModel` (hidden 128, not guidance-distilled), a CLIP and a T5 text encoder
  (hidden 64, word-level vocabularies), all trained here: the VAE first, then the transformer
  with both encoders (rectified flow, the loss FlowMatchEulerDiscreteScheduler samples, noise
  levels shifted by {SHIFT:g} as the scheduler's `shift`), 10 % empty prompts. Weights in
  float16.
- Sampling: 64x64, {table['steps']} steps, **true CFG 3.0 against the empty prompt** (the model is
  not guidance-distilled, `guidance_scale` is unused; it was trained with 10 % empty prompts
  for this). Without CFG the shapes come out with rounded corners (the table below); diffrt's
  defaults for the model are these.
- Text length: **16 tokens**. diffusers' FluxPipeline pads T5 to 512 by default, which this
  model never saw: pass `max_sequence_length=16` (diffrt reads it from the T5 tokenizer's
  `model_max_length`).
- Training: `python scripts/train_demo_model.py --out diffrt/models/diffrt-shapes --minutes
  {train.get('minutes', 30):g} --seed {train.get('seed', 0)}` ({train.get('steps', '?')}
  transformer steps, final loss {train.get('final_loss', '?')}), {train.get('threads', '?')} torch
  threads on CPU; a clock-bounded run (`--vae-steps`/`--steps` make one that repeats to the bit).

## Use

```python
import torch, diffusers
pipe = diffusers.FluxPipeline.from_pretrained("diffrt/models/diffrt-shapes",
                                              torch_dtype=torch.float32)
image = pipe("a red circle on a yellow background in the top left", negative_prompt="",
             true_cfg_scale=3.0, height=64, width=64, num_inference_steps=12,
             guidance_scale=1.0, max_sequence_length=16,
             generator=torch.Generator().manual_seed(0)).images[0]
```

or `diffrt generate -p "a red circle on a yellow background in the top left"`.

## Measured accuracy (held-out prompts)

{table['prompts']} held-out prompts, seeds 0..{table['prompts'] - 1}, {table['steps']} steps, 64x64,
float32 on CPU, negative prompt "", judged by the deterministic classifier of
`diffrt/demo/shapes.py` (colour by pixel vote, shape by bounding-box fill, position by
centroid, background by the border):

| true_cfg_scale | colour | shape | position | background |
|---|---|---|---|---|
{acc}
""", encoding="utf-8")


def evaluate(folder: Path, log: callable) -> dict:
    """Held-out prompts at EVAL_STEPS through diffusers' FluxPipeline loaded
    from ``folder``, with true CFG against the empty prompt at each of
    CFG_SCALES (1.0: none); the classifier's accuracy per attribute."""
    import diffusers

    pipe = diffusers.FluxPipeline.from_pretrained(folder, local_files_only=True,
                                                  torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    scenes = shapes.HELD_OUT[::5]  # 30 of the 146, spread over the list
    rows = []
    for cfg in CFG_SCALES:
        images = [pipe(scene.prompt, negative_prompt="", true_cfg_scale=cfg, height=64,
                       width=64, num_inference_steps=EVAL_STEPS, guidance_scale=1.0,
                       max_sequence_length=TEXT_TOKENS,
                       generator=torch.Generator().manual_seed(i)).images[0]
                  for i, scene in enumerate(scenes)]
        hits = shapes.tally(scenes, images)
        row = {"true_cfg_scale": cfg, **{name: hits[name] / len(scenes) for name in hits}}
        rows.append(row)
        log(f"held-out accuracy at true_cfg_scale {cfg:g}: " + ", ".join(
            f"{k} {v:.0%}" for k, v in row.items() if k != "true_cfg_scale")
            + f" ({len(scenes)} prompts)")
    return {"prompts": len(scenes), "steps": EVAL_STEPS, "rows": rows}


if __name__ == "__main__":
    raise SystemExit(main())
