"""What one diffrt-motion clip costs on this machine, beside another folder's.

Printed, never asserted. Run from the repository root:

    .venv/bin/python benchmarks/bench_motion_clip.py                      # the shipped folder alone
    .venv/bin/python benchmarks/bench_motion_clip.py --against /tmp/old-motion --threads 1

Issue 49 bounds a clip of the default video model at 1 s on this CPU. Each
folder runs in its own in-process engine (request mode, float32, warmed by
one clip), with the model's sampling (9 frames of 64x64, 12 steps, CFG 3
against the empty prompt) given in full, so a folder that is not the
shipped one is asked the same; rounds alternate between the folders and
each folder's figure is the median of its rounds. ``--against`` takes a
folder that runs 9 frames as asked: a Wan one (the ninth run's, say); a
Helios folder by any path but the shipped one's gets Helios' own chunks (9
latent frames), which 9 frames at 2x in time do not fill, and is refused.
"""

from __future__ import annotations

import argparse
import time

import torch

from diffrt.cli.bench_stats import median
from diffrt.demo import motion
from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams
from diffrt.engine.models.shipped import shipped_folder

#: diffrt-motion's sampling (its ShippedModel defaults), spelled out
SAMPLING = dict(height=64, width=64, num_frames=9, num_inference_steps=12, guidance_scale=3.0,
                output_type="np")


def clip_seconds(engine: DiffusionEngine, seed: int) -> float:
    request = DiffusionRequest(motion.EVALUATION[seed % len(motion.EVALUATION)].prompt,
                               request_id=f"clip-{seed}", negative_prompt="",
                               sampling_params=SamplingParams(seed=seed, **SAMPLING))
    began = time.perf_counter()
    out = engine.generate([request], timeout=600)[0]
    assert out.ok, out.error
    return time.perf_counter() - began


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--against", default=None, help="another motion folder to time beside it")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folders = {"diffrt-motion": shipped_folder("diffrt-motion")}
    if args.against:
        folders["against"] = args.against
    engines = {name: DiffusionEngine.make_engine(EngineConfig(
        model=folder, executor_backend="inproc", dtype="float32")) for name, folder in folders.items()}
    try:
        for engine in engines.values():
            clip_seconds(engine, 0)  # warm
        times: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(args.rounds):
            for name, engine in engines.items():
                times[name].append(clip_seconds(engine, r + 1))
    finally:
        for engine in engines.values():
            engine.close()
    for name, folder in folders.items():
        print(f"{name:>14}: {median(times[name]):.3f} s a clip (median of {args.rounds}, "
              f"{args.threads} thread(s)) {folder}")
    if args.against:
        print(f"diffrt-motion / against: {median(times['diffrt-motion']) / median(times['against']):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
