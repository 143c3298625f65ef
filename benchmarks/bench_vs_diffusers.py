"""diffrt against what a user runs without it: diffusers' own pipeline for the task.

Both load the same complete model folder (``--model``: the embedded
``tiny-flux`` by default, or the shipped ``diffrt-shapes``; the peer encodes
its prompts with the folder's CLIP and T5 too) and return PIL images.
Printed, never asserted. Run from the repository root:

    .venv/bin/python benchmarks/bench_vs_diffusers.py            # full run (~30 min here)
    .venv/bin/python benchmarks/bench_vs_diffusers.py --quick    # a few minutes
    .venv/bin/python benchmarks/bench_vs_diffusers.py --task image-to-image

**Tasks** (``--task``; one code path, only the request and the peer's call
differ):

- ``text-to-image`` (the default): diffusers' ``FluxPipeline``;
- ``image-to-image``: diffusers' ``FluxImg2ImgPipeline.from_pipe(base)``
  against diffrt requests with ``images=[picture]`` and ``strength``
  (``--strength``, default 0.6: 8 steps run 5); every request of both
  systems gives the same input picture (seeded, 96x80, so both resize it), a
  batch of 8 gives it 8 times (8 encodes, as 8 users' requests would);
  sizes default to 64 and 256, the issue's, and the throughput ratios are
  printed against its goals (>= 1.0x serial, >= 1.2x static batch 8);
- ``editing`` (FLUX.1 Kontext, ``--model tiny-flux-kontext``, its default
  for this task): diffusers' ``FluxKontextPipeline`` loaded from the Kontext
  folder, given ``max_area`` = the requested area and ``_auto_resize=False``
  (diffrt honours the size asked; the tiny model keeps its input's size), so
  both make the same pictures; every request edits the same seeded picture.

The peer is given what diffrt runs by default on the model (``MODELS``), so
both make the same pictures (checked by hand, one request at 64 px: equal
bytes on both models and both tasks): Flux guidance 3.5
(FluxImg2ImgPipeline's own default is 7.0); on ``diffrt-shapes`` true CFG at
3 against the empty prompt and 16 T5 tokens.

**Throughput** (closed loop, N requests of one size, ``--steps`` steps): every
(system, size) runs in a fresh process, rounds interleaved, the median of the
rounds printed with ratios:

- ``diffusers serial``: one pipeline call per request, one after another;
- ``diffusers batch 8``: the queue is full, calls of 8 prompts (the ceiling a
  static batcher can reach);
- ``diffrt serial``: the engine with max_num_seqs=1 (request mode);
- ``diffrt step x8`` / ``diffrt request x8``: max_num_seqs=8 at concurrency 8.

**Latency** (open loop): 200 requests whose (size, steps) are drawn uniformly
from {64, 256, 512} x {4, 8, 28}, Poisson arrivals at 70 % of diffrt's
capacity — its step-mode x8 closed-loop throughput on the same mix, measured in
the same run — against diffusers serially behind a lock and a static batcher
that groups by (size, steps) and waits up to 2 s to fill a batch of 8. p50 and
p99 request latency of each, in fresh processes too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

from diffrt.cli.bench_stats import median

HERE = os.path.dirname(os.path.abspath(__file__))

#: task -> (the diffusers class its peer runs, made ``from_pipe`` of the
#: base ``FluxPipeline`` — the Kontext one loaded from its own folder; the
#: sizes it runs at by default)
TASKS: dict[str, tuple[str, tuple[int, ...]]] = {
    "text-to-image": ("FluxPipeline", (64, 256, 512)),
    "image-to-image": ("FluxImg2ImgPipeline", (64, 256)),
    "editing": ("FluxKontextPipeline", (64, 256)),
}
#: the model a task runs on unless --model names another
TASK_MODELS = {"editing": "tiny-flux-kontext"}
#: model -> what diffusers is given on top of the request, to run what diffrt
#: runs by default on it, so both make the same pictures: diffrt's Flux
#: guidance (3.5: FluxPipeline's default, but FluxImg2ImgPipeline's is 7.0);
#: diffrt-shapes: true CFG at 3 against "" (``SHIPPED_MODELS``) and its 16
#: T5 tokens (its model card; diffrt reads the tokenizer's model_max_length)
MODELS: dict[str, dict[str, Any]] = {
    "tiny-flux": {"guidance_scale": 3.5},
    "tiny-flux-kontext": {"guidance_scale": 3.5},
    "diffrt-shapes": {"guidance_scale": 1.0, "true_cfg_scale": 3.0, "negative_prompt": "",
                      "max_sequence_length": 16},
}
#: throughput goals of a task: (ours, peer) -> least ratio, at GOAL_SIZES
GOALS: dict[str, dict[tuple[str, str], float]] = {
    task: {("diffrt serial", "diffusers serial"): 1.0,
           ("diffrt step x8", "diffusers batch 8"): 1.2}
    for task in ("image-to-image", "editing")}
GOAL_SIZES = (64, 256)

THROUGHPUT_SYSTEMS = ["diffusers serial", "diffusers batch 8", "diffrt serial",
                      "diffrt step x8", "diffrt request x8"]
LATENCY_SYSTEMS = ["diffrt step x8", "diffusers serial", "diffusers static batcher"]
MIX_SIZES = (64, 256, 512)
MIX_STEPS = (4, 8, 28)


# -- the systems, each in its own process ---------------------------------------------------
def _folder(model: str) -> str:
    from diffrt.engine.models.embedded import embedded_folder
    from diffrt.engine.models.shipped import SHIPPED_MODELS, shipped_folder

    return shipped_folder(model) if model in SHIPPED_MODELS else str(embedded_folder(model))


def input_picture() -> Any:
    """The input image of every image-to-image request: seeded, not the
    output size (both systems resize it)."""
    import numpy as np
    import PIL.Image

    return PIL.Image.fromarray(np.random.default_rng(7).integers(0, 255, (80, 96, 3),
                                                                 dtype=np.uint8))


def _peer_pipeline(spec: dict[str, Any]) -> Any:
    """diffusers' pipeline of the spec's task, on the spec's model."""
    import diffusers
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    cls = TASKS[spec["task"]][0]
    base = diffusers.FluxKontextPipeline if cls == "FluxKontextPipeline" else diffusers.FluxPipeline
    pipe = base.from_pretrained(_folder(spec["model"]), torch_dtype=torch.float32)
    if cls not in ("FluxPipeline", "FluxKontextPipeline"):
        pipe = getattr(diffusers, cls).from_pipe(pipe)
    pipe.set_progress_bar_config(disable=True)
    pipe.bench_kwargs = {**MODELS[spec["model"]], **_task_peer_kwargs(spec)}
    pipe.bench_picture = input_picture() if spec["task"] != "text-to-image" else None
    return pipe


def _task_peer_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """What the task adds to every diffusers call (the picture is per call)."""
    if spec["task"] == "image-to-image":
        return {"strength": spec["strength"]}
    if spec["task"] == "editing":
        return {"_auto_resize": False}
    return {}


def _peer_call(pipe: Any, prompts: list[str], size: int, steps: int, seed: int) -> list[Any]:
    import torch

    kwargs = dict(pipe.bench_kwargs)
    if pipe.bench_picture is not None:  # one input per prompt, as separate requests give
        kwargs["image"] = [pipe.bench_picture] * len(prompts)
    if "_auto_resize" in kwargs:  # Kontext: the size asked, not 1 Mpx at its aspect
        kwargs["max_area"] = size * size
    return pipe(prompt=prompts, height=size, width=size, num_inference_steps=steps,
                generator=torch.Generator().manual_seed(seed), output_type="pil",
                **kwargs).images


def _engine(system: str, spec: dict[str, Any]) -> Any:
    from diffrt.engine import DiffusionEngine, EngineConfig

    step = "step" in system
    seqs = 1 if "serial" in system else 8
    extra = dict(spec.get("engine", {}))
    if spec.get("threads"):
        extra.setdefault("torch_threads", spec["threads"])
    return DiffusionEngine.make_engine(EngineConfig(
        model=spec["model"], step_execution=step, max_num_seqs=seqs, **extra))


def _task_request_fields(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The request fields of the spec's task: (DiffusionRequest's, SamplingParams')."""
    if spec["task"] == "image-to-image":
        return {"images": [input_picture()]}, {"strength": spec["strength"]}
    if spec["task"] == "editing":
        return {"images": [input_picture()]}, {}
    return {}, {}


def _requester(spec: dict[str, Any]) -> Any:
    """``request(i, size, steps, tag)`` of the spec's task."""
    from diffrt.engine import DiffusionRequest, SamplingParams

    fields, params = _task_request_fields(spec)

    def request(i: int, size: int, steps: int, tag: str) -> Any:
        return DiffusionRequest(prompt=f"a red fox {i}", request_id=f"{tag}-{i}", **fields,
                                sampling_params=SamplingParams(
                                    height=size, width=size, num_inference_steps=steps,
                                    seed=i, **params))

    return request


def throughput_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Images per second of one system at one size (warm-up excluded)."""
    system, size, steps, n = spec["system"], spec["size"], spec["steps"], spec["requests"]
    if system.startswith("diffusers"):
        pipe = _peer_pipeline(spec)
        batch = 8 if "batch" in system else 1
        _peer_call(pipe, ["warm"] * batch, size, steps, 0)
        start = time.perf_counter()
        for first in range(0, n, batch):
            images = _peer_call(pipe, [f"a red fox {i}" for i in range(first, first + batch)],
                                size, steps, first)
            assert len(images) == batch
        wall = time.perf_counter() - start
    else:
        from diffrt.cli.bench_load import EngineTarget, drive

        engine = _engine(system, spec)
        request = _requester(spec)
        try:
            concurrency = 1 if "serial" in system else 8
            warm = [request(i, size, steps, "warm") for i in range(concurrency)]
            drive(EngineTarget(engine), warm, concurrency=concurrency, rate=None)
            samples, wall = drive(EngineTarget(engine),
                                  [request(i, size, steps, "r") for i in range(n)],
                                  concurrency=concurrency, rate=None)
            failed = [s.error for s in samples if not s.ok]
            if failed:
                raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
        finally:
            engine.close()
    return {"images_per_s": n / wall}


def _mix(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.choice(MIX_SIZES), rng.choice(MIX_STEPS)) for _ in range(n)]


def _peer_batch(pipe: Any, ids: list[int], size: int, steps: int) -> None:
    """The requests ``ids`` of one (size, steps) in one pipeline call."""
    _peer_call(pipe, [f"a red fox {i}" for i in ids], size, steps, ids[0])


def latency_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Open-loop latencies of one system on the mix (or, with ``capacity``, the
    closed-loop requests/s of diffrt step x8 on it)."""
    mix = _mix(spec["requests"], spec["seed"])
    system = spec["system"]
    if spec.get("capacity"):
        from diffrt.cli.bench_load import EngineTarget, drive

        engine = _engine("diffrt step x8", spec)
        request = _requester(spec)
        try:
            reqs = [request(i, s, st, "cap") for i, (s, st) in enumerate(mix)]
            drive(EngineTarget(engine), reqs[:8], concurrency=8, rate=None)
            samples, wall = drive(EngineTarget(engine), reqs, concurrency=8, rate=None)
        finally:
            engine.close()
        return {"requests_per_s": len(samples) / wall}
    rate = spec["rate"]
    if system.startswith("diffrt"):
        from diffrt.cli.bench_load import EngineTarget, drive

        engine = _engine(system, spec)
        request = _requester(spec)
        try:
            drive(EngineTarget(engine), [request(i, 64, 4, "warm") for i in range(2)],
                  concurrency=2, rate=None)
            samples, _ = drive(EngineTarget(engine),
                               [request(i, s, st, "lat") for i, (s, st) in enumerate(mix)],
                               concurrency=len(mix), rate=rate, seed=spec["seed"])
        finally:
            engine.close()
        if not all(s.ok for s in samples):
            raise RuntimeError("a request failed")
        return {"latencies": [s.latency for s in samples]}
    from diffusers_peers import SerialPeer, StaticBatcherPeer

    pipe = _peer_pipeline(spec)
    peer = (SerialPeer(pipe, _peer_batch) if system == "diffusers serial"
            else StaticBatcherPeer(pipe, _peer_batch, batch=8, wait_s=2.0))
    _peer_call(pipe, ["warm"], 64, 4, 0)

    async def main() -> list[float]:
        rng = random.Random(spec["seed"])  # the same arrivals as bench_load's open loop
        latencies: list[float] = [0.0] * len(mix)

        async def one(i: int, size: int, steps: int) -> None:
            start = time.perf_counter()
            await peer.run(i, size, steps)
            latencies[i] = time.perf_counter() - start

        tasks = []
        for i, (size, steps) in enumerate(mix):
            if i:
                await asyncio.sleep(rng.expovariate(rate))
            tasks.append(asyncio.create_task(one(i, size, steps)))
        await asyncio.gather(*tasks)
        return latencies

    return {"latencies": asyncio.run(main())}


# -- the parent: fresh processes, interleaved rounds, medians -----------------------------------
#: set by --peer-malloc: diffusers' processes get the allocator setting diffrt
#: gives its CPU workers, to separate that gain from the rest
PEER_ENV: dict[str, str] = {}


def _child(kind: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, json.dumps(spec)]
    env = dict(os.environ)
    if spec["system"].startswith("diffusers"):
        env.update(PEER_ENV)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} {spec} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _task_spec(args: argparse.Namespace) -> dict[str, Any]:
    """What every child of this run is given: the task, model and settings."""
    return {"task": args.task, "model": args.model, "strength": args.strength,
            "threads": args.torch_threads, "engine": args.engine}


def _what(args: argparse.Namespace) -> str:
    task = args.task + (f" (strength {args.strength:g}: {args.steps} steps run "
                        f"{_steps_run(args.steps, args.strength)})"
                        if args.task == "image-to-image" else "")
    return f"{task}, {args.model}"


def _steps_run(steps: int, strength: float) -> int:
    from diffrt.engine import SamplingParams

    return SamplingParams(num_inference_steps=steps, strength=strength).denoise_steps()


def bench_throughput(args: argparse.Namespace) -> None:
    print(f"\n== throughput: images/s, {_what(args)}, {args.steps} steps, {args.requests} "
          f"requests, median of {args.rounds} interleaved rounds, each in a fresh process ==")
    results: dict[tuple[str, int], list[float]] = defaultdict(list)
    for rnd in range(args.rounds):
        for size in args.sizes:
            systems = [x for x in THROUGHPUT_SYSTEMS if x in args.systems]
            k = rnd % len(systems)
            order = systems[k:] + systems[:k]
            for system in order:
                spec = {**_task_spec(args), "system": system, "size": size,
                        "steps": args.steps, "requests": args.requests}
                results[(system, size)].append(
                    _child("throughput", spec, args.child_timeout)["images_per_s"])
        print(f"  round {rnd + 1}/{args.rounds} done", flush=True)
    med = {k: median(v) for k, v in results.items()}
    header = "".join(f"{s:>10}" for s in args.sizes)
    print(f"{'images/s':<28}{header}")
    for system in THROUGHPUT_SYSTEMS:
        if system in args.systems:
            print(f"{system:<28}" + "".join(f"{med[(system, s)]:>10.2f}" for s in args.sizes))
    print(f"{'ratio':<28}{header}")
    for ours, peer in (("diffrt serial", "diffusers serial"),
                       ("diffrt step x8", "diffusers batch 8"),
                       ("diffrt request x8", "diffusers batch 8")):
        if ours not in args.systems or peer not in args.systems:
            continue
        print(f"{ours + ' / ' + peer:<40}"[:40] + "".join(
            f"{med[(ours, s)] / med[(peer, s)]:>10.2f}" for s in args.sizes))
    for (ours, peer), least in GOALS.get(args.task, {}).items():
        sizes = [s for s in GOAL_SIZES if s in args.sizes]
        if ours not in args.systems or peer not in args.systems or not sizes:
            continue
        ratios = [med[(ours, s)] / med[(peer, s)] for s in sizes]
        verdict = ", ".join(f"{s} px {r:.3f} {'met' if r >= least else 'NOT met'}"
                            for s, r in zip(sizes, ratios, strict=True))
        print(f"goal {ours} / {peer} >= {least:.1f}: {verdict}")


def bench_latency(args: argparse.Namespace) -> None:
    print(f"\n== latency: {_what(args)}, {args.latency_requests} requests, (size, steps) "
          f"uniform over {MIX_SIZES} x {MIX_STEPS}, Poisson arrivals ==")
    base = {**_task_spec(args), "requests": args.latency_requests, "seed": args.seed}
    capacity = _child("latency", {**base, "system": "diffrt step x8", "capacity": True},
                      args.child_timeout)["requests_per_s"]
    rate = args.load * capacity
    print(f"diffrt step x8 capacity on the mix: {capacity:.3f} req/s; arrivals at "
          f"{args.load:.0%}: {rate:.3f} req/s")
    stats: dict[str, tuple[float, float]] = {}
    for system in LATENCY_SYSTEMS:
        lat = _child("latency", {**base, "system": system, "rate": rate},
                     args.child_timeout * 4)["latencies"]
        lat.sort()
        p50 = lat[len(lat) // 2]
        p99 = lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))]
        stats[system] = (p50, p99)
        print(f"{system:<28} p50 {p50:8.2f} s   p99 {p99:8.2f} s", flush=True)
    ours = stats["diffrt step x8"]
    for peer in LATENCY_SYSTEMS[1:]:
        print(f"diffrt / {peer:<24} p50 {ours[0] / stats[peer][0]:6.2f}   "
              f"p99 {ours[1] / stats[peer][1]:6.2f}")
    best = min(stats[p][1] for p in LATENCY_SYSTEMS[1:])
    print(f"diffrt p99 / the better peer's p99: {ours[1] / best:.2f} (goal <= 0.5)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true",
                    help="sizes 64 and 256, 16 requests, 3 rounds, 60-request latency mix")
    ap.add_argument("--task", choices=list(TASKS), default="text-to-image",
                    help="what every request asks for (default: text-to-image); editing: "
                         "FLUX.1 Kontext edits")
    ap.add_argument("--model", choices=list(MODELS), default=None,
                    help="the folder both systems load (default: the embedded tiny-flux; "
                         "tiny-flux-kontext for editing)")
    ap.add_argument("--strength", type=float, default=0.6,
                    help="image-to-image: the requests' strength (default: 0.6)")
    ap.add_argument("--torch-threads", type=int, default=0, metavar="N",
                    help="torch threads of every system (the engine's torch_threads; default: "
                         "the engine's choice, torch's default for diffusers); 1 keeps a "
                         "shared machine's busy cores from stalling a worker's threads")
    ap.add_argument("--sizes", type=int, nargs="*", default=None,
                    help="throughput sizes (default: the task's: 64 256 512 for "
                         "text-to-image, 64 256 for image-to-image)")
    ap.add_argument("--systems", nargs="*", default=THROUGHPUT_SYSTEMS, choices=THROUGHPUT_SYSTEMS,
                    metavar="SYSTEM", help="throughput: which systems (default: all five)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--latency-requests", type=int, default=200)
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", type=json.loads, default={},
                    help='extra EngineConfig fields for every diffrt system, as JSON')
    ap.add_argument("--peer-malloc", action="store_true",
                    help="give diffusers the allocator setting of diffrt's CPU workers "
                         "(MALLOC_MMAP_MAX_=0, ...), to see what the rest of diffrt adds")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--child-timeout", type=float, default=900)
    args = ap.parse_args(argv)
    if args.model is None:
        args.model = TASK_MODELS.get(args.task, "tiny-flux")
    if (args.task == "editing") != (args.model == "tiny-flux-kontext"):
        ap.error("--task editing runs on tiny-flux-kontext, the other tasks on text-to-image "
                 "folders")
    if not 0.0 < args.strength <= 1.0:
        ap.error("--strength is in (0, 1]")
    if args.sizes is None:
        args.sizes = list(TASKS[args.task][1])
    if args.child:
        kind, spec = args.child[0], json.loads(args.child[1])
        fn = throughput_child if kind == "throughput" else latency_child
        print(json.dumps(fn(spec)))
        return 0
    if args.peer_malloc:
        from diffrt.engine.cpu_policy import CPU_WORKER_MALLOC_ENV

        PEER_ENV.update(CPU_WORKER_MALLOC_ENV)
    if args.quick:
        args.sizes, args.requests, args.rounds, args.latency_requests = [64, 256], 16, 3, 60
    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; task {_what(args)}, peer "
          f"{TASKS[args.task][0]}; torch threads {args.torch_threads or 'default'}; diffrt "
          f"engine extras: {args.engine or 'none'}; diffusers with diffrt's allocator "
          f"setting: {'yes' if PEER_ENV else 'no'}")
    if not args.skip_throughput:
        bench_throughput(args)
    if not args.skip_latency:
        bench_latency(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
