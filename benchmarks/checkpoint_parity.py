"""The engine against diffusers on complete tiny folders, and what the prompt
cache saves: the device check of the real-checkpoint work, also run on CPU.

Ten cases (Flux dev-style with embedded guidance, Flux with true CFG and a
negative prompt, Flux schnell-style, SD3 with and without CFG, SD3.5-style, SD3
with dynamic shifting, two SD3 requests batched, Qwen-Image with true CFG, two
Qwen-Image requests of different prompt lengths batched): each builds the folder
offline, runs diffusers' own pipeline (``from_pretrained(dtype=...)``, CPU
generators seeded as the requests, a batch as a list of prompts) and the engine
(in-process executor, request mode, the same device and dtype) and prints the
largest and mean pixel difference out of 255. Then the text encoder of one folder is timed on prompts
it has not seen (a miss: the encoders run) and on the same prompts again (a
hit: the cache answers), interleaved, medians.

    .venv/bin/python benchmarks/checkpoint_parity.py                  # CPU, float32
    .venv/bin/python benchmarks/checkpoint_parity.py --dtype bfloat16  # CPU, bf16
    python benchmarks/checkpoint_parity.py --device cuda --dtype bfloat16

Exits 1 when a case differs by more than ``--max-diff`` (default 2).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams
from diffrt.engine.models.loading import library_bars_off
from diffrt.engine.models.tiny.flux import build_tiny_flux_folder
from diffrt.engine.models.tiny.sd3 import build_tiny_sd3_folder
from diffrt.engine.pipelines import load_pipeline

SIZE, STEPS = 64, 4

#: (label, folder kind, pipeline kwargs for diffusers = request fields, batch of two)
CASES = [
    ("flux dev-style, guidance 3.5", "flux-dev", {"guidance_scale": 3.5}, False),
    ("flux true CFG 4 + negative", "flux-dev", {"true_cfg_scale": 4.0,
                                                 "negative_prompt": "blurry"}, False),
    ("flux schnell-style", "flux", {"guidance_scale": 1.0}, False),
    ("sd3 CFG 4.5", "sd3", {"guidance_scale": 4.5}, False),
    ("sd3 no CFG", "sd3", {"guidance_scale": 1.0}, False),
    ("sd3.5-style CFG 3.5 + negative", "sd35", {"guidance_scale": 3.5,
                                                 "negative_prompt": "lowres"}, False),
    ("sd3 dynamic shift CFG 2", "sd3-shift", {"guidance_scale": 2.0}, False),
    ("sd3 CFG 4.5, two requests batched", "sd3", {"guidance_scale": 4.5}, True),
    ("qwen-image true CFG 4 + negative", "qwen", {"true_cfg_scale": 4.0,
                                                   "negative_prompt": "blurry"}, False),
    ("qwen-image no CFG, two batched", "qwen", {"true_cfg_scale": 1.0}, True),
]
PROMPTS = ["a red fox in the snow", "an old castle on a hill"]


def build(kind: str, root: Path) -> Path:
    path = root / kind
    if kind == "qwen":
        from diffrt.engine.models.tiny.qwen_image import build_tiny_qwen_image_folder

        return build_tiny_qwen_image_folder(path, seed=3)
    if kind in ("flux", "flux-dev"):
        return build_tiny_flux_folder(path, seed=3, guidance_embeds=kind == "flux-dev")
    return build_tiny_sd3_folder(path, seed=3, sd35=kind == "sd35",
                                 dynamic_shifting=kind == "sd3-shift")


def diffusers_images(folder: Path, kw: dict, prompts: list[str], seeds: list[int], device: str,
                     dtype: torch.dtype) -> list[np.ndarray]:
    """diffusers' images, the prompts in one call as the engine batches them
    (in half precision a batch's matmuls round differently than one image's,
    in diffusers as in the engine: batch mates change pixels by a few /255)."""
    import diffusers

    cls = (diffusers.FluxPipeline if "flux" in folder.name else diffusers.QwenImagePipeline
           if folder.name == "qwen" else diffusers.StableDiffusion3Pipeline)
    pipe = cls.from_pretrained(folder, local_files_only=True, dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    images = pipe(prompts, height=SIZE, width=SIZE, num_inference_steps=STEPS,
                  generator=[torch.Generator("cpu").manual_seed(s) for s in seeds],
                  output_type="np", **kw).images
    return [(image * 255).round().astype(np.int16) for image in images]


def engine_images(folder: Path, kw: dict, prompts: list[str], seeds: list[int],
                  dtype_name: str) -> list[np.ndarray]:
    negative = kw.get("negative_prompt")
    params = {k: v for k, v in kw.items() if k != "negative_prompt"}
    config = EngineConfig(model=str(folder), executor_backend="inproc", dtype=dtype_name,
                          max_num_seqs=len(prompts), request_batch_max_wait_ms=50)
    with DiffusionEngine.make_engine(config) as engine:
        outs = engine.generate([
            DiffusionRequest(p, SamplingParams(height=SIZE, width=SIZE, num_inference_steps=STEPS,
                                               seed=s, **params), negative_prompt=negative)
            for p, s in zip(prompts, seeds, strict=True)])
    for out in outs:
        if not out.ok:
            raise RuntimeError(out.error)
    return [np.asarray(o.images[0]).astype(np.int16) for o in outs]


def cache_latency(folder: Path, device: str, dtype: torch.dtype, rounds: int) -> tuple[float, float]:
    """Median seconds of one prompt's encoding: a miss, then a hit, interleaved."""
    pipe = load_pipeline(str(folder), device=device, dtype=dtype)
    sync = torch.accelerator.synchronize if device != "cpu" else None
    pipe.enable_prompt_cache(64 << 20, synchronize=sync)
    misses, hits = [], []
    for i in range(rounds + 1):
        prompt = f"a lighthouse at dusk, take {i}"
        for bucket in (misses, hits):  # the first call misses, the same prompt then hits
            start = time.perf_counter()
            pipe.text_encoder([prompt])
            if sync is not None:
                sync()
            if i:  # round 0 warms the kernels up
                bucket.append(time.perf_counter() - start)
    return statistics.median(misses), statistics.median(hits)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--max-diff", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20, help="cache latency rounds")
    args = ap.parse_args()
    if args.device != "cpu":  # the engine picks the platform's device itself
        print(f"engine device: the platform's (diffrt env); diffusers on {args.device}")
    dtype = getattr(torch, args.dtype)
    worst = 0
    with tempfile.TemporaryDirectory() as tmp, library_bars_off():
        root = Path(tmp)
        folders: dict[str, Path] = {}
        print(f"{'case':40s} {'max /255':>8s} {'mean /255':>9s}")
        for label, kind, kw, batched in CASES:
            folder = folders.get(kind) or folders.setdefault(kind, build(kind, root))
            prompts = PROMPTS if batched else PROMPTS[:1]
            seeds = list(range(len(prompts)))
            ours = engine_images(folder, kw, prompts, seeds, args.dtype)
            theirs = diffusers_images(folder, kw, prompts, seeds, args.device, dtype)
            diffs = [np.abs(a - b) for a, b in zip(ours, theirs, strict=True)]
            biggest = max(int(d.max()) for d in diffs)
            worst = max(worst, biggest)
            mean = float(np.mean([d.mean() for d in diffs]))
            print(f"{label:40s} {biggest:8d} {mean:9.3f}")
        miss, hit = cache_latency(folders["flux-dev"], args.device, dtype, args.rounds)
    print(f"text encoding of one prompt ({args.device}, {args.dtype}, tiny CLIP + T5): "
          f"miss {miss * 1e3:.3f} ms, hit {hit * 1e3:.3f} ms, hit/miss {hit / miss:.3f}")
    verdict = "ok" if worst <= args.max_diff else "FAILED"
    print(f"largest difference {worst}/255 (limit {args.max_diff}): {verdict}")
    return 0 if worst <= args.max_diff else 1


if __name__ == "__main__":
    sys.exit(main())
