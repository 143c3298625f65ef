"""Train the demo model ``diffrt-shapes``: a tiny Flux that draws what its prompt says.

    .venv/bin/python scripts/train_demo_model.py --out diffrt/models/diffrt-shapes
    .venv/bin/python scripts/train_demo_model.py --out /tmp/shapes --minutes 3   # a quick trial

Deterministic (seeded data, weights and batches; the same torch build and
thread count give the same folder) and bounded by the clock: about a third of
``--minutes`` trains the VAE, the rest the transformer with both text
encoders, then the folder is written in float16 and evaluated. Not run by CI.

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
from diffrt.engine.pipelines.tiny_folders import (
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
SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
EVAL_STEPS = 12


def words() -> tuple[str, ...]:
    return tuple(dict.fromkeys(w for s in shapes.all_scenes() for w in s.prompt.split()))


def pictures(scenes: list[shapes.Scene], rng: np.random.Generator) -> torch.Tensor:
    """(N, 3, 64, 64) in [-1, 1]."""
    arrays = [np.asarray(shapes.random_render(s, rng), dtype=np.float32) for s in scenes]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2) / 127.5 - 1.0


def train_vae(seconds: float, rng: np.random.Generator, log: callable,
              latent_channels: int) -> torch.nn.Module:
    from diffusers import AutoencoderKL

    with seeded_init(1):
        vae = AutoencoderKL(**{**VAE, "latent_channels": latent_channels})
    optimiser = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    start, step = time.monotonic(), 0
    while time.monotonic() - start < seconds:
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
                 ) -> tuple[list[shapes.Scene], torch.Tensor]:
    """VARIANTS renders of every training scene, encoded once (the VAE's mode,
    unscaled): the transformer's batches are drawn from here, so its steps do
    not pay for the VAE's encoder."""
    scenes = [s for s in shapes.TRAIN for _ in range(VARIANTS)]
    with torch.no_grad():
        latents = torch.cat([vae.encode(pictures(scenes[i:i + 256], rng)).latent_dist.mode()
                             for i in range(0, len(scenes), 256)])
    return scenes, latents


def reconstruction_accuracy(vae: torch.nn.Module, rng: np.random.Generator) -> str:
    """The classifier on the VAE's reconstructions of held-out pictures: what
    the transformer can reach at best."""
    scenes = shapes.HELD_OUT[::3]
    with torch.no_grad():
        recon = vae.decode(vae.encode(pictures(scenes, rng)).latent_dist.mode()).sample
    images = ((recon.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()
    hits: dict[str, int] = {}
    for scene, image in zip(scenes, images, strict=True):
        for name, ok in shapes.score(scene, shapes.classify(image)).items():
            hits[name] = hits.get(name, 0) + ok
    return ", ".join(f"{k} {v / len(scenes):.0%}" for k, v in hits.items())


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


def image_ids(h: int, w: int) -> torch.Tensor:
    ids = torch.zeros(h, w, 3)
    ids[..., 1] += torch.arange(h)[:, None]
    ids[..., 2] += torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder to write")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--latent-channels", type=int, default=4,
                    help="VAE latent channels (the transformer takes 4x as many)")
    ap.add_argument("--vae-share", type=float, default=0.15,
                    help="share of --minutes that trains the VAE")
    ap.add_argument("--batch", type=int, default=32, help="transformer batch size")
    ap.add_argument("--lr", type=float, default=5e-4, help="transformer peak learning rate")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    out = Path(args.out)
    began = time.monotonic()

    def log(text: str) -> None:
        print(f"[{(time.monotonic() - began) / 60:5.1f} min] {text}", flush=True)

    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    budget = args.minutes * 60
    vae = train_vae(budget * args.vae_share, rng, log, args.latent_channels)
    log(f"vae done; its reconstructions of held-out pictures read back: "
        f"{reconstruction_accuracy(vae, rng)}")
    cache_scenes, cache = latent_cache(vae, rng)
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
    step, losses = 0, []
    train_until = budget * 0.95 - (time.monotonic() - began)  # keep time for the evaluation
    start = time.monotonic()
    for module in (transformer, clip, t5):
        module.train()
    while time.monotonic() - start < train_until:
        picks = rng.integers(len(cache_scenes), size=args.batch)
        prompts = ["" if rng.random() < 0.1 else cache_scenes[i].prompt for i in picks]
        x0 = cache[torch.from_numpy(picks)]
        noise = torch.randn_like(x0)
        sigma = torch.sigmoid(torch.randn(args.batch))[:, None, None]
        xt = (1 - sigma) * x0 + sigma * noise
        embeds, pooled = encode_prompts((clip_tok, t5_tok), (clip, t5), prompts)
        pred = transformer(hidden_states=xt, encoder_hidden_states=embeds,
                           pooled_projections=pooled, timestep=sigma.view(-1), img_ids=ids,
                           txt_ids=txt_ids, guidance=None, return_dict=False)[0]
        loss = F.mse_loss(pred, noise - x0)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for group in optimiser.param_groups:  # cosine decay over the time budget
            done = (time.monotonic() - start) / train_until
            group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))
        optimiser.step()
        losses.append(loss.item())
        step += 1
        if step % 50 == 0:
            log(f"step {step}: loss {np.mean(losses[-50:]):.4f}")

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
                         "batch": args.batch, "lr": args.lr,
                         "final_loss": round(float(np.mean(losses[-50:])), 4)}
    (out / "evaluation.json").write_text(json.dumps(table, indent=2) + "\n", encoding="utf-8")
    write_model_card(out, table)
    return 0


def write_model_card(out: Path, table: dict) -> None:
    """The folder's README.md: what it is, what it was trained on, how to
    retrain it, how to load it, what it measures."""
    acc = " | ".join(f"{table[k]:.0%}" for k in ("colour", "shape", "position", "background"))
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
  with both encoders (rectified flow, the loss FlowMatchEulerDiscreteScheduler samples), 10 %
  empty prompts. Weights in float16.
- Text length: **16 tokens**. diffusers' FluxPipeline pads T5 to 512 by default, which this
  model never saw: pass `max_sequence_length=16` (diffrt reads it from the T5 tokenizer's
  `model_max_length`).
- Training: `python scripts/train_demo_model.py --out diffrt/models/diffrt-shapes --minutes
  {train.get('minutes', 30):g} --seed {train.get('seed', 0)}` ({train.get('steps', '?')}
  transformer steps, final loss {train.get('final_loss', '?')}), on 2 CPU cores.

## Use

```python
import torch, diffusers
pipe = diffusers.FluxPipeline.from_pretrained("diffrt/models/diffrt-shapes",
                                              torch_dtype=torch.float32)
image = pipe("a red circle on a yellow background in the top left", height=64, width=64,
             num_inference_steps=12, guidance_scale=1.0, max_sequence_length=16,
             generator=torch.Generator().manual_seed(0)).images[0]
```

or `diffrt generate -p "a red circle on a yellow background in the top left"`.

## Measured accuracy (held-out prompts)

{table['prompts']} held-out prompts, seeds 0..{table['prompts'] - 1}, {EVAL_STEPS} steps, 64x64,
float32 on CPU, judged by the deterministic classifier of `diffrt/demo/shapes.py` (colour by
pixel vote, shape by bounding-box fill, position by centroid, background by the border):

| colour | shape | position | background |
|---|---|---|---|
| {acc} |
""", encoding="utf-8")


def evaluate(folder: Path, log: callable) -> dict:
    """Held-out prompts at EVAL_STEPS through diffusers' FluxPipeline loaded
    from ``folder``; the classifier's accuracy per attribute."""
    import diffusers

    pipe = diffusers.FluxPipeline.from_pretrained(folder, local_files_only=True,
                                                  torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    scenes = shapes.HELD_OUT[::5]  # 30 of the 146, spread over the list
    hits = {"colour": 0, "shape": 0, "position": 0, "background": 0}
    for i, scene in enumerate(scenes):
        image = pipe(scene.prompt, height=64, width=64, num_inference_steps=EVAL_STEPS,
                     guidance_scale=1.0, max_sequence_length=TEXT_TOKENS,
                     generator=torch.Generator().manual_seed(i)).images[0]
        for name, ok in shapes.score(scene, shapes.classify(image)).items():
            hits[name] += ok
    table = {name: hits[name] / len(scenes) for name in hits}
    table["prompts"] = len(scenes)
    log("held-out accuracy: " + ", ".join(f"{k} {v:.0%}" for k, v in table.items()
                                          if k != "prompts") + f" ({len(scenes)} prompts)")
    return table


if __name__ == "__main__":
    raise SystemExit(main())
