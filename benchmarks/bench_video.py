"""diffrt on video against diffusers' ``WanPipeline`` (issue 47), tiny-Wan.

Both load the same folder (the embedded ``tiny-wan``: Wan 2.2 A14B's layout,
two experts) and run what diffrt runs by default on it (CFG 5.0 against the
empty prompt, UMT5 padded to 512 tokens: ``WanPipeline``'s own defaults), the
same steps and the same seeds, and return PIL frames. Printed, never
asserted. Run from the repository root:

    .venv/bin/python benchmarks/bench_video.py              # a few minutes here
    .venv/bin/python benchmarks/bench_video.py --rounds 5 --frames 81 --size 256

Three parts, each system of each round in a fresh process, the order of the
systems rotating between rounds, the median of the rounds printed:

1. **serial**: ``--requests`` clips of ``--frames`` x ``--size``\\ :sup:`2`
   one after another: ``diffrt serial`` (request-batch execution,
   ``max_num_seqs=1``, concurrency 1) against ``diffusers serial`` (one
   ``WanPipeline`` call per clip); clips/s and their ratio (goal >= 1.0).
2. **step x4**: 4 clips of different frame counts (``--mix``: 33 25 17 9)
   at ``--size``\\ :sup:`2`, submitted together to a step-batch engine
   (``max_num_seqs=4``: their steps share ticks; Wan runs a call per latent
   size, so a tick is 4 calls, one a clip) against diffusers running the same 4
   clips one after another; clips/s and the ratio (goal >= 1.0).
3. **image under load**: the smallest request the video model takes — one
   frame (``num_frames=1``: a clip is 4k + 1 frames) at ``--image-size``\\ :sup:`2`,
   priority 0 — on a step-batch engine with ``scheduling_policy="slo"``,
   ``max_num_seqs=4`` and ``max_steps_per_tick=1`` (an arrival waits for one
   step of the running batch, not four), alone (median of 3) and then
   submitted once 4 clips of ``--frames`` (priority 5) have run their first
   step; its latency under load over its solo latency (goal <= 2.0).

diffrt runs its default multiprocess executor (``--executor``: ``mp``; the
worker process adds a transfer of the frames per request). Every system runs
``--torch-threads`` torch threads (default 1: the engine's CPU worker and
diffusers alike; on a shared 2-core machine more threads stall each other).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

from diffrt.cli.bench_stats import median

MODEL = "tiny-wan"
VIDEO_PRIORITY = 5
IMAGE_PRIORITY = 0
SOLO_RUNS = 3
PROMPT = "a red fox in the snow {}"

#: part -> its systems (each a fresh process a round)
PARTS: dict[str, tuple[str, ...]] = {
    "serial": ("diffusers serial", "diffrt serial"),
    "step x4": ("diffusers serial", "diffrt step x4"),
    "image under load": ("diffrt slo",),
}


# -- the systems, each in its own process ---------------------------------------------------
def _workload(spec: dict[str, Any]) -> list[tuple[int, int]]:
    """(frames, seed) of every clip of the spec's part."""
    if spec["part"] == "serial":
        return [(spec["frames"], i) for i in range(spec["requests"])]
    return [(frames, i) for i, frames in enumerate(spec["mix"])]


def _request(i: int, frames: int, size: int, steps: int, tag: str, priority: int = 0) -> Any:
    from diffrt.engine import DiffusionRequest, SamplingParams

    return DiffusionRequest(prompt=PROMPT.format(i), request_id=f"{tag}-{i}",
                            sampling_params=SamplingParams(
                                height=size, width=size, num_frames=frames,
                                num_inference_steps=steps, seed=i, priority=priority))


def _engine(spec: dict[str, Any], *, step: bool, seqs: int, **extra: Any) -> Any:
    from diffrt.engine import DiffusionEngine, EngineConfig

    return DiffusionEngine.make_engine(EngineConfig(
        model=MODEL, executor_backend=spec["executor"], step_execution=step,
        max_num_seqs=seqs, torch_threads=spec["threads"], **extra))


def _peer(spec: dict[str, Any]) -> float:
    """diffusers' ``WanPipeline``, the part's clips one call each: clips/s."""
    import diffusers
    import torch

    from diffrt.engine.models.embedded import embedded_folder

    torch.set_num_threads(spec["threads"])
    pipe = diffusers.WanPipeline.from_pretrained(embedded_folder(MODEL), local_files_only=True,
                                                 torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)

    def call(frames: int, seed: int) -> None:
        video = pipe(prompt=PROMPT.format(seed), num_frames=frames, height=spec["size"],
                     width=spec["size"], num_inference_steps=spec["steps"],
                     generator=torch.Generator("cpu").manual_seed(seed),
                     output_type="pil").frames[0]
        assert len(video) == frames

    clips = _workload(spec)
    call(*clips[0])  # warm-up
    start = time.perf_counter()
    for frames, seed in clips:
        call(frames, seed)
    return len(clips) / (time.perf_counter() - start)


def _ours(spec: dict[str, Any]) -> float:
    """diffrt serial (request batch, one at a time) or step x4 (all the
    part's clips together): clips/s."""
    from diffrt.cli.bench_load import EngineTarget, drive

    serial = spec["system"] == "diffrt serial"
    clips = _workload(spec)
    concurrency = 1 if serial else len(clips)
    engine = _engine(spec, step=not serial, seqs=concurrency)
    try:
        size, steps = spec["size"], spec["steps"]
        warm = [_request(s, f, size, steps, "warm") for f, s in clips[:concurrency]]
        drive(EngineTarget(engine), warm, concurrency=concurrency, rate=None)
        samples, wall = drive(EngineTarget(engine),
                              [_request(s, f, size, steps, "r") for f, s in clips],
                              concurrency=concurrency, rate=None)
    finally:
        engine.close()
    failed = [s.error for s in samples if not s.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    return len(clips) / wall


def _image_under_load(spec: dict[str, Any]) -> dict[str, float]:
    """The one-frame request's latency alone (median of SOLO_RUNS) and while
    4 clips run, on one slo engine."""
    from diffrt.cli.bench_load import EngineTarget

    size, steps, image = spec["size"], spec["steps"], spec["image_size"]
    engine = _engine(spec, step=True, seqs=4, scheduling_policy="slo", max_steps_per_tick=1)
    target = EngineTarget(engine)

    def image_request(i: int, tag: str) -> Any:
        return _request(1000 + i, 1, image, steps, tag, priority=IMAGE_PRIORITY)

    async def loaded() -> tuple[float, float]:
        videos = [asyncio.create_task(target.run_request(
            _request(i, spec["frames"], size, steps, "video", priority=VIDEO_PRIORITY)))
            for i in range(4)]
        before = engine.stats().step_batch_rows.count
        while engine.stats().step_batch_rows.count == before:  # their first step ran
            await asyncio.sleep(0.005)
        sample = await target.run_request(image_request(0, "loaded"))
        done = await asyncio.gather(*videos)
        if not sample.ok or not all(s.ok for s in done):
            raise RuntimeError(f"a request failed: {sample.error or done}")
        return sample.latency, median([s.latency for s in done])

    try:
        asyncio.run(target.run_request(image_request(0, "warm")))
        solo = []
        for i in range(SOLO_RUNS):
            sample = asyncio.run(target.run_request(image_request(i, "solo")))
            if not sample.ok:
                raise RuntimeError(sample.error)
            solo.append(sample.latency)
        latency, videos = asyncio.run(loaded())
    finally:
        engine.close()
    return {"solo_s": median(solo), "loaded_s": latency, "videos_s": videos}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    if spec["part"] == "image under load":
        return _image_under_load(spec)
    rate = _peer(spec) if spec["system"].startswith("diffusers") else _ours(spec)
    return {"clips_per_s": rate}


# -- the parent: fresh processes, interleaved rounds, medians ---------------------------------
def _run_child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _verdict(value: float, goal: float, most: bool = False) -> str:
    met = value <= goal if most else value >= goal
    return f"goal {'<=' if most else '>='} {goal:.1f}: {'met' if met else 'NOT met'}"


def run(args: argparse.Namespace) -> None:
    base = {"size": args.size, "frames": args.frames, "steps": args.steps,
            "requests": args.requests, "mix": args.mix, "image_size": args.image_size,
            "threads": args.torch_threads, "executor": args.executor}
    runs = [(part, system) for part in args.parts for system in PARTS[part]]
    results: dict[tuple[str, str], list[dict[str, float]]] = defaultdict(list)
    for rnd in range(args.rounds):
        k = rnd % len(runs)
        for part, system in runs[k:] + runs[:k]:
            spec = {**base, "part": part, "system": system}
            results[(part, system)].append(_run_child(spec, args.child_timeout))
        print(f"  round {rnd + 1}/{args.rounds} done", flush=True)

    def med(part: str, system: str, key: str) -> float:
        return median([r[key] for r in results[(part, system)]])

    print(f"\n== tiny-wan, {args.steps} steps, median of {args.rounds} interleaved rounds, "
          f"each system a fresh process ==")
    if "serial" in args.parts:
        peer, ours = (med("serial", s, "clips_per_s") for s in PARTS["serial"])
        print(f"1. serial, {args.requests} clips of {args.frames} x {args.size}^2:  "
              f"diffusers {peer:.3f} clips/s, diffrt serial {ours:.3f} clips/s, "
              f"ratio {ours / peer:.2f}x ({_verdict(ours / peer, 1.0)})")
    if "step x4" in args.parts:
        peer, ours = (med("step x4", s, "clips_per_s") for s in PARTS["step x4"])
        mix = "/".join(str(f) for f in args.mix)
        print(f"2. {len(args.mix)} clips of {mix} frames x {args.size}^2:  diffusers serial "
              f"{peer:.3f} clips/s, diffrt step x{len(args.mix)} {ours:.3f} clips/s, "
              f"ratio {ours / peer:.2f}x ({_verdict(ours / peer, 1.0)})")
    if "image under load" in args.parts:
        solo, loaded, videos = (med("image under load", "diffrt slo", key)
                                for key in ("solo_s", "loaded_s", "videos_s"))
        print(f"3. 1 frame x {args.image_size}^2 (priority 0), slo:  solo {solo:.3f} s, "
              f"beside 4 clips of {args.frames} x {args.size}^2 (priority 5) {loaded:.3f} s, "
              f"ratio {loaded / solo:.2f}x ({_verdict(loaded / solo, 2.0, most=True)}); "
              f"the clips' median latency {videos:.2f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--frames", type=int, default=33,
                    help="frames of part 1's and part 3's clips (4k + 1; default 33)")
    ap.add_argument("--size", type=int, default=128,
                    help="the clips' side, px (a multiple of 16; default 128)")
    ap.add_argument("--steps", type=int, default=4, help="every request's steps (default 4)")
    ap.add_argument("--requests", type=int, default=2,
                    help="part 1: clips a round (default 2)")
    ap.add_argument("--mix", type=int, nargs="+", default=[33, 25, 17, 9],
                    help="part 2: the frame counts of the clips run together")
    ap.add_argument("--image-size", type=int, default=64,
                    help="part 3: the one-frame request's side, px (default 64)")
    ap.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS),
                    metavar="PART", help=f"which parts (default all: {', '.join(PARTS)})")
    ap.add_argument("--torch-threads", type=int, default=1, metavar="N")
    ap.add_argument("--executor", choices=("mp", "inproc"), default="mp",
                    help="diffrt's executor backend (default mp)")
    ap.add_argument("--child-timeout", type=float, default=900)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}; diffrt executor {args.executor}; torch threads "
          f"{args.torch_threads} in every system")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
