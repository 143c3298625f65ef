"""Train the video demo model ``diffrt-motion``: a tiny Helios that draws the motion its prompt says.

    .venv/bin/python scripts/train_motion_model.py --out /tmp/motion              # the full run
    .venv/bin/python scripts/train_motion_model.py --out /tmp/motion --minutes 20 # 20 min, then stop
    .venv/bin/python scripts/train_motion_model.py --out /tmp/motion --resume     # go on from there

Bounded by steps (``--vae-steps``, ``--steps``), seeded (data, weights,
batches) and resumable: every ``--checkpoint-every`` steps, and when an
invocation's ``--minutes`` run out, the whole state (weights, optimisers, the
data and noise generators' states, the step, the losses) goes to
``<out>.work/checkpoint.pt``; ``--resume`` goes on from it, so a run cut into
pieces gives the same folder as one in a go (same torch build and threads).

1. Data (``diffrt.demo.motion``): 9-frame 64x64 clips of one shape moving,
   growing, shrinking or standing still; the 117 held-out combinations are
   never seen.
2. VAE: a small diffusers ``AutoencoderKLWan`` (4x in space, 2x in time
   by default (``--time-compression``; 4x lost moving shapes), 8 latent
   channels: a clip is 5 latent frames of 16x16), trained on
   reconstruction (L1 + MSE, the shape's pixels weighted 5x, the first
   frame 4x, a tiny KL) of whole 9-frame clips. Its encoder
   and decoder are causal and chunked (the first frame, then groups of 4),
   each group reading the causal cache the one before left: a VAE trained on
   5-frame clips (one group) decoded a 9-frame clip's second group with its
   colours drifting (per-frame error 11-17 levels in the first group, 48-106
   in the second), so the clips it trains on are as long as the ones it
   serves. 1,200 steps of batch 4 (20 min here) were too few for 9-frame
   clips: the held-out clips' reconstructions kept their direction in 3 of
   30 and their colour in 9; 1,800 steps, decoding the posterior's mode.
   Trained, not fixed: Wan's VAE normalises features with RMS norms and
   gates them with SiLU, so no setting of its weights is a plain
   downsampling, and a folder diffusers' ``HeliosPipeline`` loads must hold
   this class (Helios' VAE is Wan's). The latent cache's per-channel mean
   and spread become the VAE's ``latents_mean`` / ``latents_std``, as the
   pipelines read them.
3. Transformer + text encoder: a ``HeliosTransformer3DModel`` — Wan's
   blocks, and the patch embeddings of the earlier chunks' latents that
   Helios attends to (patch (1, 2, 2), 8x8 tokens a latent frame, 320 a
   clip, one chunk; a step of batch 16 took 0.9 CPU-seconds at patch 2
   against 4.4 with ``--patch 1``) — and a UMT5 encoder, trained jointly
   from scratch on the one chunk a clip is, given the zero history
   ``HeliosPipeline`` gives a first chunk. Helios rather than Wan because
   that history is fixed content at fixed places, so the transformer can
   tell where a token is, which Wan's relative positions never tell it
   (docs/motion-model.md); a ``PositionProbe`` loss makes it learn to.
   The rectified-flow loss (``x_t = (1 - s) x0 + s noise``, target
   ``noise - x0``, logit-normal ``s`` shifted by 3, timestep ``1000 s``),
   the prompt encoded as ``HeliosPipeline.encode_prompt`` does (UMT5 last
   hidden states zeroed past the prompt's tokens) but padded
   to ``--text-tokens`` (16; the folder's tokenizer says so, and diffrt's Helios
   pipeline reads it) rather than 512, whose 500 zero rows become 500 equal
   keys in every cross-attention; the ``phrases`` tokenizer (each motion and
   each background one token: see ``build_tokenizer``), 10 % empty prompts
   (for CFG against ""), the tokens on and around the shape weighted 5x.
4. Evaluation: the 30 held-out prompts of ``motion.EVALUATION`` through
   diffusers' ``HeliosPipeline`` loaded from the written folder, read back by
   the classifier; the table goes to ``evaluation.json`` and the model card.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from diffrt.demo import motion
from diffrt.demo.shapes import BACKGROUNDS
from diffrt.engine.models.tiny.helios import write_helios_index
from diffrt.engine.models.tiny.shared import build_t5_tokenizer, seeded_init, t5_pieces
from diffrt.engine.pipelines.helios.history import first_chunk_inputs

#: the prompt's tokens the encoder reads (the longest prompt is 11 words + </s>)
PROMPT_TOKENS = 16
#: what Wan's and Helios' pipelines pad the encoder's output to by default (diffrt's and
#: diffusers'); ``--text-tokens`` trains (and the folder's tokenizer asks) fewer
TEXT_TOKENS = 512
LATENT = 8
VAE = dict(base_dim=12, z_dim=LATENT, dim_mult=[1, 2, 2], num_res_blocks=1,
           temperal_downsample=[True, True], scale_factor_spatial=4, scale_factor_temporal=4)
#: ``--time-compression``: the VAE's downsampling in time (4: 9 frames are 3
#: latent frames; 2: 5; 1: 9). At 4x a latent frame holds four frames of a
#: shape that travels 18 px across them, and the eighth run's VAE drew moving
#: shapes at 1-3 % of their area (median) in the second group's first two
#: frames; the ninth run's, at 2x, drew them at 79-91 % in every frame
TIME_DOWNSAMPLE = {4: [True, True], 2: [False, True], 1: [False, False]}
UMT5 = dict(d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2,
            relative_attention_num_buckets=8, relative_attention_max_distance=16,
            feed_forward_proj="gated-gelu", dropout_rate=0.0)
TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32,
                   in_channels=LATENT, out_channels=LATENT, text_dim=UMT5["d_model"],
                   freq_dim=64, ffn_dim=384, num_layers=4, cross_attn_norm=True,
                   qk_norm="rms_norm_across_heads", rope_dim=(8, 12, 12))
SHIFT = 3.0
#: weight of the position loss (``PositionProbe``) beside the flow loss
POSITION_WEIGHT = 0.1
#: Helios-Base's one-stage UniPC (HeliosPipeline passes its own sigmas)
SCHEDULER = dict(num_train_timesteps=1000, stages=1)
WARMUP_STEPS = 100
SHAPE_WEIGHT = 4.0
#: the VAE's first frame weighs as a group of four (whatever the time
#: compression: the weight was measured at 4x): Wan's VAE encodes and
#: decodes it alone (a path of its own), and at one ninth of the loss every
#: VAE trained here left it the worst (35-60 levels of mean error, even its
#: plain background 61 off, against 14 for the other frames); 400 steps on
#: that frame alone brought its background from 63 to 16 levels off
FIRST_FRAME_WEIGHT = 4.0
#: sampling of the evaluation and of diffrt's defaults for the model
#: issue 49's goals on the held-out prompts, by attribute (the model card's last row)
GOALS = {"direction": 0.9, "colour": 0.9, "background": 0.9, "shape": 0.8}
EVAL = dict(num_frames=motion.FRAMES, height=64, width=64, num_inference_steps=12,
            guidance_scale=3.0)
#: arguments a resumed run may change (how it runs, not what it trains)
RUN_ONLY = ("out", "resume", "minutes", "threads", "checkpoint_every", "eval_count",
            "evaluate_only")
#: frames of a VAE training clip: a served clip's (the first, then the rest in
#: groups of ``--time-compression``)
VAE_FRAMES = motion.FRAMES


def words() -> tuple[str, ...]:
    return tuple(dict.fromkeys(w for c in motion.all_clips() for w in c.prompt.split()))


def phrases() -> tuple[str, ...]:
    """The phrases the ``phrases`` tokenizer keeps whole: each motion
    ("moving left to right") and each background ("yellow background")."""
    return (*(motion.verb(d) for d in motion.DIRECTIONS), *(f"{b} background" for b in BACKGROUNDS))


def build_tokenizer(folder: Path, kind: str, max_length: int):
    """The model's tokenizer, written to ``folder``.

    ``words``: T5's (Unigram over whitespace-split words). Wan's
    cross-attention has no positions, so over word tokens "left to right"
    and "right to left" are the same keys, as are a shape's "red" and a
    background's "red": only the encoder, trained from scratch, could tell
    them apart by order. ``phrases``: the same Unigram over the whole
    prompt, with each motion and each background one piece (scored above
    its words), so each of the four attributes is a token of its own. A
    transformers ``PreTrainedTokenizerFast`` (T5's class rebuilds the
    whitespace split on loading); the folder's ``model_index.json`` names it.
    """
    if kind == "words":
        return build_t5_tokenizer(folder, extra=words(), max_length=max_length)
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import Unigram
    from transformers import PreTrainedTokenizerFast

    pieces = t5_pieces(words()) + [("▁" + p.replace(" ", "▁"), -1.0) for p in phrases()]
    backend = Tokenizer(Unigram(pieces, unk_id=2, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always",
                                                     split=False)
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=False)
    backend.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=max_length,
                                        pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    tokenizer.save_pretrained(folder)
    return tokenizer


def clips_tensor(videos: list[np.ndarray]) -> torch.Tensor:
    """(N, F, H, W, 3) uint8 -> (N, 3, F, H, W) in [-1, 1]."""
    return torch.from_numpy(np.stack(videos)).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0


def to_frames(video: torch.Tensor) -> np.ndarray:
    """(3, F, H, W) in [-1, 1] -> (F, H, W, 3) uint8, rounded as diffusers' video processor."""
    return ((video.clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 3, 0).numpy()


def build_models(tokenizer_vocab: int, patch: int = 2,
                 time_compression: int = 4) -> dict[str, torch.nn.Module]:
    from diffusers import AutoencoderKLWan, HeliosTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    with seeded_init(1):
        vae = AutoencoderKLWan(**{**VAE, "temperal_downsample": TIME_DOWNSAMPLE[time_compression],
                                  "scale_factor_temporal": time_compression})
    with seeded_init(2):
        encoder = UMT5EncoderModel(UMT5Config(vocab_size=tokenizer_vocab, pad_token_id=0,
                                              eos_token_id=1, decoder_start_token_id=0,
                                              is_encoder_decoder=False, **UMT5))
    with seeded_init(3):
        transformer = HeliosTransformer3DModel(**{**TRANSFORMER, "patch_size": (1, patch, patch)})
    return {"vae": vae, "text_encoder": encoder, "transformer": transformer}


def encode_prompts(tokenizer, encoder, prompts: list[str], length: int) -> torch.Tensor:
    """As HeliosPipeline's (Wan's) ``_get_t5_prompt_embeds`` with ``max_sequence_length
    = length``: the last hidden states of the prompt's tokens, zeros after
    them up to ``length``. The encoder runs on PROMPT_TOKENS only: its mask
    keeps a prompt's states from the padding, so they equal those of a run
    over ``length``."""
    text = tokenizer(prompts, padding="max_length", max_length=PROMPT_TOKENS, truncation=True,
                     return_attention_mask=True, return_tensors="pt")
    states = encoder(text.input_ids, text.attention_mask).last_hidden_state
    states = states * text.attention_mask[..., None]
    return F.pad(states, (0, 0, 0, length - PROMPT_TOKENS))


def chunk_frames(time_compression: int) -> int:
    """Latent frames of a clip (the first frame, then groups): one chunk."""
    return 1 + (motion.FRAMES - 1) // time_compression


class PositionProbe(torch.nn.Module):
    """A training device, not part of the model: a linear read-out of each
    chunk token's place (column, row, latent frame) from the transformer's
    first block, trained with cross-entropy beside the flow loss. Helios'
    history makes the place computable (Wan's relative positions do not);
    without the probe's loss, 1,500 steps did not learn to compute it (the
    shape drawn in one place for every motion: docs/motion-model.md), with
    it the first block reads every token's place within 500 steps."""

    def __init__(self, width: int, side: int, frames: int):
        super().__init__()
        self.sizes = (side, side, frames)
        self.read = torch.nn.Linear(width, sum(self.sizes))
        t, y, x = torch.meshgrid(torch.arange(frames), torch.arange(side), torch.arange(side),
                                 indexing="ij")
        # each token's (column, row, frame), in the tokens' raster order
        self.register_buffer("places", torch.stack([x.flatten(), y.flatten(), t.flatten()]),
                             persistent=False)
        self.hidden: torch.Tensor | None = None

    def watch(self, transformer: torch.nn.Module) -> torch.utils.hooks.RemovableHandle:
        """Keep the first block's output of every call (until the handle is removed)."""
        return transformer.blocks[0].register_forward_hook(
            lambda _module, _inputs, out: setattr(self, "hidden", out))

    def loss(self) -> torch.Tensor:
        """Cross-entropy of the last call's chunk tokens (the history's come first)."""
        assert self.hidden is not None
        tokens = self.places.shape[1]
        logits = self.read(self.hidden[:, -tokens:]).split(self.sizes, dim=-1)
        return sum(F.cross_entropy(lg.flatten(0, 1), place.repeat(lg.shape[0]))
                   for lg, place in zip(logits, self.places, strict=True))


def shifted(sigma: torch.Tensor) -> torch.Tensor:
    return SHIFT * sigma / (1 + (SHIFT - 1) * sigma)


def shape_mask(videos: torch.Tensor, clips: list[motion.Clip]) -> torch.Tensor:
    """(N, F, H, W): 1 where a frame's pixel is not the clip's background."""
    from diffrt.demo.shapes import PALETTE

    back = torch.tensor([PALETTE[c.background] for c in clips], dtype=torch.float32)
    back = back[:, :, None, None, None] / 127.5 - 1.0
    return ((videos - back).abs().amax(1) > 0.1).float()


def pixel_weights(videos: torch.Tensor, clips: list[motion.Clip]) -> torch.Tensor:
    """(N, 1, F, H, W) reconstruction weights: 1 + SHAPE_WEIGHT on the shape
    and the two pixels around it. Unweighted, the shape is 8 % of a frame's
    pixels: after 1,600 steps a VAE had learnt the backgrounds and lost the
    shape (held-out round trips kept the direction of 3 of 30 clips)."""
    near = F.max_pool3d(shape_mask(videos, clips)[:, None], (1, 5, 5), stride=1,
                        padding=(0, 2, 2))
    return 1.0 + SHAPE_WEIGHT * near


def token_weights(videos: torch.Tensor, clips: list[motion.Clip],
                  time_compression: int = 4) -> torch.Tensor:
    """(N, F', 16, 16) latent-pixel weights: 1 + SHAPE_WEIGHT where a latent
    frame's pixels (its group of ``time_compression`` frames; the first frame
    alone) hold the shape or touch its outline (one pixel around: with patch
    2 a token's weight is the mean of its 4)."""
    shape = shape_mask(videos, clips)  # (N, F, H, W)
    t = time_compression
    groups = [shape[:, :1]] + [shape[:, 1 + t * k:1 + t * (k + 1)]
                               for k in range((shape.shape[1] - 1) // t)]
    merged = torch.stack([g.amax(1) for g in groups], 1)  # (N, F', H, W)
    n, f, h, w = merged.shape
    tokens = F.max_pool2d(merged.view(n * f, 1, h, w), 4)
    tokens = F.max_pool2d(tokens, 3, stride=1, padding=1)
    return 1.0 + SHAPE_WEIGHT * tokens.view(n, f, h // 4, w // 4)


class Run:
    """The training state and what saves and restores it (see the module)."""

    def __init__(self, args: argparse.Namespace, log: Callable[[str], None]):
        self.args, self.log = args, log
        self.work = Path(f"{args.out}.work")
        self.work.mkdir(parents=True, exist_ok=True)
        self.tokenizer = build_tokenizer(self.work / "tokenizer", args.tokenizer, args.text_tokens)
        torch.manual_seed(args.seed)
        self.rng = np.random.default_rng(args.seed)
        self.models = build_models(len(self.tokenizer), args.patch, args.time_compression)
        with seeded_init(4):
            self.probe = PositionProbe(TRANSFORMER["num_attention_heads"]
                                       * TRANSFORMER["attention_head_dim"],
                                       64 // VAE["scale_factor_spatial"] // args.patch,
                                       chunk_frames(args.time_compression))
        self.probe.watch(self.models["transformer"])
        self.vae_opt = torch.optim.AdamW(self.models["vae"].parameters(), lr=args.vae_lr,
                                         weight_decay=0.0)
        self.params = [*self.models["transformer"].parameters(),
                       *self.models["text_encoder"].parameters(), *self.probe.parameters()]
        self.opt = torch.optim.AdamW(self.params, lr=args.lr, weight_decay=0.0)
        self.vae_step = self.step = 0
        self.vae_losses: list[float] = []
        self.losses: list[float] = []
        self.cache: dict[str, torch.Tensor] | None = None
        self.began = time.monotonic()

    # -- checkpoints -------------------------------------------------------------
    def save(self) -> None:
        state = {"models": {k: m.state_dict() for k, m in self.models.items()},
                 "probe": self.probe.state_dict(),
                 "vae_opt": self.vae_opt.state_dict(), "opt": self.opt.state_dict(),
                 "vae_step": self.vae_step, "step": self.step, "vae_losses": self.vae_losses,
                 "losses": self.losses, "rng": self.rng.bit_generator.state,
                 "torch_rng": torch.get_rng_state(), "args": vars(self.args)}
        torch.save(state, self.work / "checkpoint.tmp")
        (self.work / "checkpoint.tmp").replace(self.work / "checkpoint.pt")
        self.log(f"checkpoint: vae step {self.vae_step}, step {self.step}")

    def restore(self) -> None:
        state = torch.load(self.work / "checkpoint.pt", weights_only=False)
        changed = {k: (v, vars(self.args).get(k)) for k, v in state["args"].items()
                   if k not in RUN_ONLY and vars(self.args).get(k) != v}
        if changed:  # another run's steps: the schedule and the data would not continue
            raise SystemExit(f"--resume with other training arguments (checkpoint, now): {changed}")
        for k, m in self.models.items():
            m.load_state_dict(state["models"][k])
        self.probe.load_state_dict(state["probe"])
        self.vae_opt.load_state_dict(state["vae_opt"])
        self.opt.load_state_dict(state["opt"])
        self.vae_step, self.step = state["vae_step"], state["step"]
        self.vae_losses, self.losses = state["vae_losses"], state["losses"]
        self.rng.bit_generator.state = state["rng"]
        torch.set_rng_state(state["torch_rng"])
        self.log(f"resumed: vae step {self.vae_step}, step {self.step}")

    def take_vae(self, work: Path) -> None:
        """The VAE (trained) and the latent cache of another run's work folder
        (``--vae-from``): a trial of the transformer's recipe on the same
        latents, without training the VAE again."""
        state = torch.load(work / "checkpoint.pt", weights_only=False)
        if state["vae_step"] < state["args"]["vae_steps"]:
            raise SystemExit(f"--vae-from {work}: its VAE is not done training")
        theirs = state["args"].get("time_compression", 4)
        if theirs != self.args.time_compression:
            raise SystemExit(f"--vae-from {work}: its VAE compresses time {theirs}x, this run "
                             f"{self.args.time_compression}x")
        self.models["vae"].load_state_dict(state["models"]["vae"])
        self.vae_step, self.vae_losses = self.args.vae_steps, state["vae_losses"]
        self.cache = torch.load(work / "latents.pt")
        torch.save(self.cache, self.work / "latents.pt")
        self.log(f"VAE and latent cache from {work}")

    def out_of_time(self) -> bool:
        return self.args.minutes > 0 and time.monotonic() - self.began > self.args.minutes * 60

    def lr(self, step: int, total: int, peak: float) -> float:
        return peak * min(1.0, (step + 1) / WARMUP_STEPS) * 0.5 * (
            1 + math.cos(math.pi * min(1.0, step / max(1, total))))

    def optimise(self, optimiser: torch.optim.Optimizer, loss: torch.Tensor, lr: float,
                 losses: list[float], label: str, step: int,
                 clip: list[torch.nn.Parameter] | None = None) -> None:
        """One optimiser step at ``lr`` (gradients clipped to norm 1 over
        ``clip``); the loss recorded, logged every 25 steps, the state
        checkpointed every ``--checkpoint-every``."""
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(clip, 1.0)
        for group in optimiser.param_groups:
            group["lr"] = lr
        optimiser.step()
        losses.append(round(loss.item(), 5))
        if step % 25 == 0:
            self.log(f"{label} {step}: loss {np.mean(losses[-25:]):.4f}")
        if step % self.args.checkpoint_every == 0:
            self.save()

    # -- phase 1: the VAE --------------------------------------------------------
    def vae_loss(self, clips: list[motion.Clip]) -> torch.Tensor:
        vae = self.models["vae"]
        batch = clips_tensor([motion.random_render(c, self.rng, VAE_FRAMES) for c in clips])
        posterior = vae.encode(batch).latent_dist
        # the mode, not a sample: what the latent cache encodes and the
        # pipeline decodes; a sample's noise (the posterior starts at unit
        # spread) buried the clip's signal for the first ~600 steps here
        recon = vae.decode(posterior.mode()).sample
        kl = posterior.kl().mean() / batch[0].numel()
        weights = pixel_weights(batch, clips)
        weights[:, :, 0] *= FIRST_FRAME_WEIGHT
        err = recon - batch
        return (weights * (err.abs() + err * err)).mean() / weights.mean() + 1e-4 * kl

    def train_vae(self) -> bool:
        """True when the phase is done (False: out of time, checkpointed)."""
        vae, a = self.models["vae"].train(), self.args
        while self.vae_step < a.vae_steps:
            if self.out_of_time():
                return False
            clips = [motion.TRAIN[i] for i in self.rng.integers(len(motion.TRAIN), size=a.vae_batch)]
            loss = self.vae_loss(clips)
            self.vae_step += 1
            self.optimise(self.vae_opt, loss, self.lr(self.vae_step - 1, a.vae_steps, a.vae_lr),
                          self.vae_losses, "vae step", self.vae_step)
        vae.eval()
        return True

    # -- phase 2: the latent cache -----------------------------------------------
    def build_cache(self) -> None:
        """``--variants`` renders of every training clip, encoded once (the
        VAE's mode, normalised per channel), their token weights, and the
        clip indices; kept in the work folder (a resumed run reuses it)."""
        path = self.work / "latents.pt"
        if path.exists() and self.vae_step >= self.args.vae_steps:
            self.cache = torch.load(path)
            return
        vae = self.models["vae"].eval()
        rng = np.random.default_rng(self.args.seed + 1)  # its own stream: resumable as is
        count = self.args.cache_clips or len(motion.TRAIN)  # a trial's subset: spread
        chosen = np.linspace(0, len(motion.TRAIN) - 1, count).round().astype(int)
        index = [int(i) for i in chosen for _ in range(self.args.variants)]
        latents, weights = [], []
        with torch.no_grad():
            for start in range(0, len(index), 64):
                clips = [motion.TRAIN[i] for i in index[start:start + 64]]
                videos = clips_tensor([motion.random_render(c, rng) for c in clips])
                latents.append(vae.encode(videos).latent_dist.mode())
                weights.append(token_weights(videos, clips, self.args.time_compression))
        z = torch.cat(latents)
        mean, std = z.mean((0, 2, 3, 4)), z.std((0, 2, 3, 4))
        shape = (1, LATENT, 1, 1, 1)
        self.cache = {"latents": (z - mean.view(shape)) / std.view(shape),
                      "weights": torch.cat(weights), "index": torch.tensor(index),
                      "mean": mean, "std": std}
        torch.save(self.cache, path)
        self.log(f"latent cache: {len(index)} clips, latents {tuple(z.shape[1:])}")

    # -- phase 3: transformer and text encoder -----------------------------------
    def transformer_loss(self, picks: np.ndarray, prompts: list[str]) -> torch.Tensor:
        assert self.cache is not None
        x0 = self.cache["latents"][torch.from_numpy(picks)]
        weights = self.cache["weights"][torch.from_numpy(picks)]
        noise = torch.randn_like(x0)
        sigma = shifted(torch.sigmoid(torch.randn(len(picks))))
        s = sigma.view(-1, 1, 1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        embeds = encode_prompts(self.tokenizer, self.models["text_encoder"], prompts,
                                self.args.text_tokens)
        pred = self.models["transformer"](hidden_states=xt, timestep=sigma * 1000,
                                          encoder_hidden_states=embeds, return_dict=False,
                                          **first_chunk_inputs(xt))[0]
        per_token = ((pred - (noise - x0)) ** 2).mean(1)  # (N, F', h, w)
        flow = (per_token * weights).sum() / weights.sum()
        return flow + POSITION_WEIGHT * self.probe.loss()

    def train_transformer(self) -> bool:
        assert self.cache is not None
        a = self.args
        for m in ("transformer", "text_encoder"):
            self.models[m].train()
        index = self.cache["index"]
        while self.step < a.steps:
            if self.out_of_time():
                return False
            picks = self.rng.integers(len(index), size=a.batch)
            prompts = ["" if self.rng.random() < 0.1 else motion.TRAIN[int(index[i])].prompt
                       for i in picks]
            loss = self.transformer_loss(picks, prompts)
            self.step += 1
            self.optimise(self.opt, loss, self.lr(self.step - 1, a.steps, a.lr), self.losses,
                          "step", self.step, clip=self.params)
        return True

    # -- the folder ----------------------------------------------------------------
    def write_folder(self) -> Path:
        from diffusers import HeliosScheduler

        assert self.cache is not None
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        vae = self.models["vae"]
        vae.register_to_config(latents_mean=[float(x) for x in self.cache["mean"]],
                               latents_std=[float(x) for x in self.cache["std"]])
        for name, module in self.models.items():
            module.eval().to(torch.float16).save_pretrained(out / name, safe_serialization=True)
            module.to(torch.float32)
        self.tokenizer.save_pretrained(out / "tokenizer")
        HeliosScheduler(**SCHEDULER).save_pretrained(out / "scheduler")
        write_helios_index(out)
        if self.args.tokenizer == "phrases":  # not T5's class: see build_tokenizer
            index_path = out / "model_index.json"
            index = json.loads(index_path.read_text(encoding="utf-8"))
            index["tokenizer"] = ["transformers", "PreTrainedTokenizerFast"]
            index_path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        return out

    def text_only_error(self, count: int = 60) -> float:
        """How much of a held-out clip's latents the prompt alone predicts:
        the transformer's clean-latent estimate from pure noise (sigma 1,
        where the input holds nothing of the clip), its mean squared error
        over the latents' variance (1: the prompt says nothing; 0: all)."""
        assert self.cache is not None
        clips = motion.HELD_OUT[:count]
        rng = np.random.default_rng(self.args.seed + 2)
        shape = (1, LATENT, 1, 1, 1)
        with torch.no_grad():
            z = self.models["vae"].eval().encode(
                clips_tensor([motion.random_render(c, rng) for c in clips])).latent_dist.mode()
            x0 = (z - self.cache["mean"].view(shape)) / self.cache["std"].view(shape)
            noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
            embeds = encode_prompts(self.tokenizer, self.models["text_encoder"].eval(),
                                    [c.prompt for c in clips], self.args.text_tokens)
            pred = self.models["transformer"].eval()(
                hidden_states=noise, timestep=torch.full((len(clips),), 1000.0),
                encoder_hidden_states=embeds, return_dict=False, **first_chunk_inputs(noise))[0]
        return float(((noise - pred - x0) ** 2).mean() / x0.var())


def evaluate(folder: Path, log: Callable[[str], None], count: int = 30) -> dict:
    """The first ``count`` of motion.EVALUATION through diffusers'
    HeliosPipeline loaded from ``folder`` (seeds 0.., EVAL's settings, a
    clip one chunk, prompts padded to the tokenizer's ``model_max_length``),
    read back."""
    import diffusers

    pipe = diffusers.HeliosPipeline.from_pretrained(folder, local_files_only=True,
                                                    torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    length = min(TEXT_TOKENS, int(pipe.tokenizer.model_max_length))
    chunk = chunk_frames(pipe.vae.config.scale_factor_temporal)
    clips = motion.EVALUATION[:count]
    videos = [(pipe(c.prompt, negative_prompt="", output_type="np", max_sequence_length=length,
                    num_latent_frames_per_chunk=chunk, generator=torch.Generator().manual_seed(i),
                    **EVAL).frames[0] * 255).round()
              for i, c in enumerate(clips)]
    hits = motion.tally(clips, videos)
    row = {k: hits[k] / len(clips) for k in motion.ATTRIBUTES}
    log("held-out accuracy: " + ", ".join(f"{k} {v:.0%}" for k, v in row.items())
        + f" ({len(clips)} prompts, guidance_scale {EVAL['guidance_scale']:g})")
    return {"prompts": len(clips), "sampling": EVAL, "accuracy": row}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", required=True, help="folder to write (work state in <out>.work)")
    ap.add_argument("--resume", action="store_true", help="go on from <out>.work/checkpoint.pt")
    ap.add_argument("--minutes", type=float, default=0.0,
                    help="stop (checkpointed) after this long; 0: run to the end")
    ap.add_argument("--vae-steps", type=int, default=1800)
    ap.add_argument("--steps", type=int, default=3000, help="transformer steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--vae-batch", type=int, default=4)
    ap.add_argument("--vae-lr", type=float, default=2e-3)
    ap.add_argument("--batch", type=int, default=16, help="transformer batch")
    ap.add_argument("--lr", type=float, default=1e-3, help="transformer peak learning rate")
    ap.add_argument("--variants", type=int, default=4, help="renders of each training clip cached")
    ap.add_argument("--cache-clips", type=int, default=0,
                    help="cache only this many training combinations, spread (a trial; 0: all)")
    ap.add_argument("--patch", type=int, default=2, choices=(1, 2),
                    help="the transformer's spatial patch (2: 8x8 tokens a latent frame, "
                         "1: 16x16, about 5x the cost of a step)")
    ap.add_argument("--time-compression", type=int, default=2, choices=(4, 2, 1),
                    help="the VAE's downsampling in time (9 frames: 3, 5 or 9 latent frames; "
                         "the transformer's tokens grow alike)")
    ap.add_argument("--tokenizer", choices=("phrases", "words"), default="phrases",
                    help="each motion and background one token (phrases), or T5's words")
    ap.add_argument("--text-tokens", type=int, default=PROMPT_TOKENS,
                    help="what prompts are padded to (the tokenizer's model_max_length; "
                         "Helios' default is 512)")
    ap.add_argument("--vae-from", type=Path, metavar="WORK",
                    help="take the trained VAE and latent cache of another run's work folder")
    ap.add_argument("--checkpoint-every", type=int, default=100)
    ap.add_argument("--eval-count", type=int, default=30, help="held-out prompts evaluated")
    ap.add_argument("--evaluate-only", action="store_true", help="measure the folder --out again")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    began = time.monotonic()

    def log(text: str) -> None:
        print(f"[{(time.monotonic() - began) / 60:5.1f} min] {text}", flush=True)

    out = Path(args.out)
    if args.evaluate_only:
        table = json.loads((out / "evaluation.json").read_text(encoding="utf-8"))
        table.update(evaluate(out, log, args.eval_count))
        record(out, table)
        return 0
    run = Run(args, log)
    if args.resume and (run.work / "checkpoint.pt").exists():
        run.restore()
    elif args.vae_from:
        run.take_vae(args.vae_from)
    if not run.train_vae():
        run.save()
        return 3
    run.build_cache()
    if not run.train_transformer():
        run.save()
        return 3
    run.save()
    folder = run.write_folder()
    log(f"wrote {folder} after {run.vae_step} VAE and {run.step} transformer steps")
    table = evaluate(folder, log, args.eval_count)
    table["text_only_error"] = round(run.text_only_error(), 4)
    log(f"text-only error (held-out, from pure noise): {table['text_only_error']}")
    table["training"] = {k: v for k, v in vars(args).items() if k not in ("resume", "minutes")}
    table["training"]["final_loss"] = round(float(np.mean(run.losses[-50:])), 4)
    table["training"]["vae_final_loss"] = round(float(np.mean(run.vae_losses[-50:])), 4)
    table["training"]["loss_curve"] = {s: round(float(np.mean(run.losses[max(0, s - 50):s])), 4)
                                       for s in range(50, run.step + 1, 250)}
    record(out, table)
    return 0


def tokenizer_line(kind: str) -> str:
    """The model card's words for ``--tokenizer``."""
    if kind == "phrases":
        return ("each motion (\"moving left to right\") and each background (\"yellow background\") "
                "one token, other words one token each (`PreTrainedTokenizerFast`)")
    return "one token a word (T5's Unigram over whitespace-split words)"


def vae_from_line(train: dict) -> str:
    """The card's words for a run that took its VAE from another (``--vae-from``):
    the batches it drew differ from a run in one go, whose VAE phase draws
    from the same generator first."""
    if not train.get("vae_from"):
        return ""
    return ("\n  Its VAE and latent cache came from the work folder of an earlier run with the same"
            "\n  VAE arguments, given as `--vae-from` (`--steps 0` makes such a run stop after its"
            "\n  VAE): a run in one go trains the same VAE but draws other batches for the"
            "\n  transformer.")


def record(out: Path, table: dict) -> None:
    """The folder's evaluation.json and model card (train_demo_model.py's, for this world)."""
    # default=str: the arguments' paths (--vae-from) as text
    (out / "evaluation.json").write_text(json.dumps(table, indent=2, default=str) + "\n",
                                         encoding="utf-8")
    write_model_card(out, table)


def write_model_card(out: Path, table: dict) -> None:
    """The folder's README.md: what it is, how it was trained, how to load
    it, what it measures."""
    train = table.get("training", {})
    length = train.get("text_tokens", TEXT_TOKENS)
    chunk = chunk_frames(train.get("time_compression", 4))
    acc = " | ".join(f"{table['accuracy'][k]:.0%}" for k in motion.ATTRIBUTES)
    goals = " | ".join(f"{GOALS[k]:.0%}" for k in motion.ATTRIBUTES)
    short = ("\nWhere it falls short of the goals, and why: diffrt's `docs/motion-model.md`.\n"
             if any(table["accuracy"][k] < GOALS[k] for k in motion.ATTRIBUTES) else "")
    (out / "README.md").write_text(f"""---
library_name: diffusers
pipeline_tag: text-to-video
---
# diffrt-motion

A tiny text-to-video model in diffusers' Helios layout (`HeliosPipeline`), trained from scratch
on synthetic 9-frame 64x64 clips of one shape: "a red circle moving left to right on a yellow
background". A clip is one Helios chunk of {chunk} latent frames.

- Vocabulary: 3 shapes x 6 colours x 9 backgrounds (never the shape's colour) x 7 motions
  (moving left to right / right to left / top to bottom / bottom to top, growing, shrinking,
  standing still); prompts are `a <colour> <shape> <motion> on a <background> background`.
  117 of the 1008 combinations were held out of training (`diffrt/demo/motion.py`).
- Components: `AutoencoderKLWan` (4x in space, {train.get('time_compression', 4)}x in time, {LATENT} latent channels, trained here),
  a {TRANSFORMER['num_layers']}-block `HeliosTransformer3DModel` (Wan's blocks and its history patches; hidden 128,
  patch (1, {train.get('patch', 2)}, {train.get('patch', 2)})), trained on the first chunk's zero history (a read-out of each
  token's place from its first block trained beside it, weight {POSITION_WEIGHT:g}, not kept),
  a UMT5 text encoder (d_model 64), trained jointly from scratch (rectified flow, noise levels
  shifted by {SHIFT:g}), 10 % empty prompts. Weights in float16.
- Tokenizer: {tokenizer_line(train.get('tokenizer', 'words'))}; prompts padded to
  {length} tokens (the tokenizer's `model_max_length`; pass `max_sequence_length={length}` to
  diffusers, whose default is 512).
- Sampling: 64x64, 9 frames (`num_latent_frames_per_chunk={chunk}`: one chunk; diffusers'
  default, 9, is a chunk of {8 * train.get('time_compression', 4) + 1} frames here), 12 steps, guidance_scale 3 against the empty prompt.
- Training: `python scripts/train_motion_model.py --out diffrt/models/diffrt-motion
  --seed {train.get('seed', 0)} --patch {train.get('patch', 2)} --time-compression {train.get('time_compression', 4)} --tokenizer {train.get('tokenizer', 'words')} --text-tokens {length}
  --vae-steps {train.get('vae_steps', '?')} --steps {train.get('steps', '?')} --lr {train.get('lr', '?')}` (final loss
  {train.get('final_loss', '?')}), {train.get('threads', '?')} torch threads on CPU.{vae_from_line(train)}

## Use

```python
import torch, diffusers
pipe = diffusers.HeliosPipeline.from_pretrained("diffrt/models/diffrt-motion",
                                                torch_dtype=torch.float32)
frames = pipe("a red circle moving left to right on a yellow background", negative_prompt="",
              height=64, width=64, num_frames=9, num_latent_frames_per_chunk={chunk},
              num_inference_steps=12, guidance_scale=3.0, max_sequence_length={length},
              output_type="np", generator=torch.Generator().manual_seed(0)).frames[0]
```

## Measured accuracy (held-out prompts)

{table['prompts']} held-out prompts (`motion.EVALUATION`), seeds 0..{table['prompts'] - 1},
diffusers' `HeliosPipeline` on this folder in float32 on CPU, judged by the deterministic
classifier of `diffrt/demo/motion.py`:

| {' | '.join(motion.ATTRIBUTES)} |
|---|---|---|---|
| {acc} |
| goal: {goals} |
{short}""", encoding="utf-8")


if __name__ == "__main__":
    raise SystemExit(main())
