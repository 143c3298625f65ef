"""Mixed traffic: requests that are not alike, on diffrt and on what people run without it.

The round's harness (issue 29; the later issues add their request kinds).
tiny-flux, N requests whose size is drawn from {64x64, 128x128, 64x128,
128x64, 256x256} and steps from {4, 8, 16} (seeded). Four systems:

- ``diffrt mixed``: step mode, max_num_seqs=16, sizes sharing steps
  (``mixed_size_batching``, the default);
- ``diffrt keyed``: the same with ``mixed_size_batching=False`` and the
  ``skip_ahead`` policy (the best an engine keyed by size does);
- ``diffusers serial``: diffusers' FluxPipeline behind a lock, one request at
  a time;
- ``diffusers static``: diffusers behind a static batcher grouping by
  (size, steps), up to 16 a call, a group waiting at most 2 s to fill.

Two measures, each system in a fresh process, rounds interleaved (the order
rotates), medians printed with ratios; nothing asserted:

- **closed loop** at concurrency 16: requests/s end to end, and the seconds
  spent in the transformer, the VAE and the text encoders
  (``stage_timers.py``, installed in diffrt's worker processes as a plugin
  module); *transformer throughput* is requests per transformer-second;
- **open loop**: Poisson arrivals at 70 % of the keyed engine's closed-loop
  capacity of the same round: p50 and p99 latency.

diffrt runs its default multiprocess executor (one CPU worker, the threads
it chooses); diffusers runs in the measuring process with torch's default
threads.

Per-call overhead (``DIFFRT_CALL_OVERHEAD_MS=N`` in the environment; issue
50): diffrt's workers sleep N ms before each transformer call
(``call_overhead.py``, a plugin module), standing in for a device's kernel
launches, and both diffrt systems run ``mixed_rows="packed"`` (one call for
every row of a step), so the step-cost model can find sharing worth it;
``--diffrt-only`` then leaves the diffusers peers out (their calls get no
overhead, and that goal compares mixed with keyed only). ``--mixed-policy
skip_ahead`` gives ``diffrt mixed`` the keyed engine's policy, so the two
differ in mixing alone.
With ``$DIFFRT_BENCH_COSTS`` set, each diffrt run appends its prediction
error and share/split counts there as a JSON line.

Adapter traffic (``--lora-share S``): a share S of the requests (seeded,
drawn apart from the shapes, so the shapes stay those above) names one of
three rank-8 LoRA adapters A, B, C (``bench_lora.py``'s, made offline on
tiny-flux), uniformly. diffrt registers them (``lora_modules``) and serves
any mix of them in one step; ``diffrt keyed`` keys by size only, as before.
diffusers switches with ``set_adapters`` (``disable_lora`` for a request
without one) before each call; its static batcher groups by
(size, steps, adapter). Without the option nothing changes.

Image traffic (``--image-share S``): a share S of the requests (seeded, drawn
apart from the shapes and adapters) gives an input picture (one seeded
96x80 picture for all, resized to each request's size) at strength 0.6
(``IMAGE_STRENGTH``); half of those (drawn) also give a mask (its bottom-right
quarter white): image-to-image and inpainting (docs/images.md). diffrt
serves them in the same steps as text-to-image requests; diffusers runs
``FluxImg2ImgPipeline`` / ``FluxInpaintPipeline`` made ``from_pipe`` of its
``FluxPipeline`` (the same modules), and its static batcher also groups by
task. The table then adds each task's p50 and p99 (open loop), and the VAE
column counts encodes too. Without the option nothing changes.

Edit traffic (``--edit-share S``): the whole run moves to ``tiny-flux-kontext``
(the tiny Flux components under ``FluxKontextPipeline``'s index, which serves
text-to-image without an image and FLUX.1 Kontext edits with one); a share S
of the requests (drawn as the image share is) edits the same seeded picture,
whose latent tokens lengthen that request's rows. diffrt serves edits and
text-to-image requests in the same steps; diffusers runs its
``FluxKontextPipeline`` for both (given ``max_area`` = the requested area and
``_auto_resize=False``, so it draws the size asked, as diffrt does), its
static batcher grouping by task too. Not combined with ``--image-share`` (a
Kontext folder serves no image-to-image) or ``--lora-share`` (the adapters are
made on tiny-flux).

Step-cache traffic (``--cache-share S``): a share S of the requests (seeded,
drawn apart from the shapes, adapters and tasks) asks for
``cache="first-block"`` at the model's default threshold (its registry
entry's, else the policy's: ``DEFAULT_THRESHOLDS``). diffrt decides per
request inside the step batches (``engine.cache``); ``diffrt keyed`` runs
them the same way. diffusers runs their calls with its own First-Block Cache
enabled (``transformer.enable_cache(FirstBlockCacheConfig(threshold))``, the
same threshold; disabled for the other requests' calls) and its static
batcher groups by the cache flag too; diffusers decides once per call (the
batch's rows together, each CFG branch apart), and its image-to-image,
inpainting and Kontext pipelines set no ``cache_context``, so the benchmark
wraps their call in one. The table then adds the share of the cached
requests' steps that reused (diffrt: ``EngineStats.cache_steps_total``;
diffusers: its head block's decisions, counted). Without the option nothing
changes.

Priorities and deadlines (``--slo``): a run of its own (``bench_slo.py``):
two priority classes with deadlines from their solo times (interactive and
batch images, or with ``--slo-mix video`` images and clips), Poisson
arrivals at 80 % and 110 % of the closed-loop capacity that each policy's
process measures on a fifo engine of its own; policies fifo, skip_ahead and
slo (or one ``slo@N`` row per ``--slo-aging-ticks`` value); deadline
attainment per class, goodput, p99.

``--torch-threads N`` gives every system N torch threads (the engine's
``torch_threads``, ``torch.set_num_threads`` for diffusers); 1 keeps a
shared machine's busy cores from stalling a worker's threads. Run from the
repository root:

    .venv/bin/python benchmarks/bench_mixed_traffic.py            # 200 requests, 2 rounds
    .venv/bin/python benchmarks/bench_mixed_traffic.py --quick    # 48 requests, 1 round
    .venv/bin/python benchmarks/bench_mixed_traffic.py --quick --lora-share 0.5
    .venv/bin/python benchmarks/bench_mixed_traffic.py --image-share 0.3
    .venv/bin/python benchmarks/bench_mixed_traffic.py --edit-share 0.3
    .venv/bin/python benchmarks/bench_mixed_traffic.py --cache-share 0.5
    .venv/bin/python benchmarks/bench_mixed_traffic.py --slo
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from diffrt.cli.bench_stats import median, percentile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SIZES = ((64, 64), (128, 128), (64, 128), (128, 64), (256, 256))
STEPS = (4, 8, 16)
SYSTEMS = ("diffrt mixed", "diffrt keyed", "diffusers serial", "diffusers static")
PEERS = SYSTEMS[2:]


def systems_of(args: argparse.Namespace) -> tuple[str, ...]:
    """The systems a run measures: all four, or diffrt's two (``--diffrt-only``:
    the per-call overhead's question is mixed against keyed only)."""
    return SYSTEMS[:2] if args.diffrt_only else SYSTEMS
CONCURRENCY = 16
MAX_NUM_SEQS = 16
STATIC_WAIT_S = 2.0
LORA_NAMES = ("A", "B", "C")
TASKS = ("text-to-image", "image-to-image", "inpainting", "editing")
#: diffusers' pipeline of each task, made from_pipe of the FluxPipeline
PEER_CLASSES = {"image-to-image": "FluxImg2ImgPipeline", "inpainting": "FluxInpaintPipeline"}
IMAGE_STRENGTH = 0.6


def traffic(n: int, seed: int) -> list[tuple[int, int, int]]:
    """(height, width, steps) of each request."""
    rng = random.Random(seed)
    return [(*rng.choice(SIZES), rng.choice(STEPS)) for _ in range(n)]


def adapter_traffic(n: int, seed: int, share: float) -> list[str | None]:
    """Each request's adapter (None: none): a share ``share`` of them, uniform
    over A, B, C; drawn from their own generator (the shapes stay as they were)."""
    rng = random.Random(f"lora {seed}")
    return [rng.choice(LORA_NAMES) if rng.random() < share else None for _ in range(n)]


def image_traffic(n: int, seed: int, share: float) -> list[str]:
    """Each request's task: a share ``share`` of them give an input picture,
    half of those (drawn) a mask too; from their own generator (the shapes
    and adapters stay as they were)."""
    rng = random.Random(f"image {seed}")
    return [(TASKS[1] if rng.random() < 0.5 else TASKS[2]) if rng.random() < share else TASKS[0]
            for _ in range(n)]


def edit_traffic(n: int, seed: int, share: float) -> list[str]:
    """Each request's task on the Kontext folder: a share ``share`` of them edit."""
    rng = random.Random(f"image {seed}")
    return ["editing" if rng.random() < share else TASKS[0] for _ in range(n)]


def cache_traffic(n: int, seed: int, share: float) -> list[bool]:
    """Whether each request asks for the first-block step cache: a share
    ``share`` of them, from their own generator (the rest stays as it was)."""
    rng = random.Random(f"cache {seed}")
    return [rng.random() < share for _ in range(n)]


def cache_threshold(model: str) -> float:
    """First-Block Cache's threshold of a request that names none on ``model``
    (what diffusers is given too)."""
    from diffrt.engine.cache.policies import DEFAULT_THRESHOLDS, FIRST_BLOCK
    from diffrt.engine.models.registry import resolve_model_spec

    return resolve_model_spec(model).cache.thresholds.get(FIRST_BLOCK,
                                                         DEFAULT_THRESHOLDS[FIRST_BLOCK])


def model_of(spec: dict[str, Any]) -> str:
    """The folder every system of the run loads."""
    return "tiny-flux-kontext" if spec.get("edit_share") else "tiny-flux"


def input_picture() -> Any:
    """Every image request's input: seeded, not any request's size (it is resized)."""
    import numpy as np
    import PIL.Image

    return PIL.Image.fromarray(np.random.default_rng(7).integers(0, 255, (80, 96, 3),
                                                                 dtype=np.uint8))


def input_mask() -> Any:
    """Every inpainting request's mask: the picture's bottom-right quarter repainted."""
    import numpy as np
    import PIL.Image

    mask = np.zeros((80, 96), np.uint8)
    mask[40:, 48:] = 255
    return PIL.Image.fromarray(mask)


# -- one system in a fresh process ---------------------------------------------------------------
def _engine(system: str, timers: str, adapters: dict[str, str], threads: int = 0,
            model: str = "tiny-flux", mixed_policy: str | None = None) -> Any:
    from diffrt.engine import DiffusionEngine, EngineConfig

    extra: dict[str, Any] = {}
    if system == "diffrt mixed" and mixed_policy:
        extra["scheduling_policy"] = mixed_policy
    if system == "diffrt keyed":
        extra = {"mixed_size_batching": False, "scheduling_policy": "skip_ahead"}
    if adapters:
        extra |= {"lora_modules": adapters, "max_loras": len(adapters) + 1}
    if threads:
        extra["torch_threads"] = threads
    overhead = os.environ.get("DIFFRT_CALL_OVERHEAD_MS", "")
    if overhead:  # the per-call overhead knob (call_overhead.py): one call for every row
        extra.setdefault("mixed_rows", "packed")
    path = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
    return DiffusionEngine.make_engine(EngineConfig(
        model=model, step_execution=True, max_num_seqs=MAX_NUM_SEQS,
        plugin_modules=("stage_timers", "call_overhead"),
        worker_env={"PYTHONPATH": path, "DIFFRT_STAGE_TIMERS": timers,
                    "DIFFRT_CALL_OVERHEAD_MS": overhead}, **extra))


def _request(i: int, height: int, width: int, steps: int, tag: str,
             adapter: str | None = None, task: str = TASKS[0], cached: bool = False) -> Any:
    from diffrt.engine import DiffusionRequest, SamplingParams

    images = [input_picture()] if task != TASKS[0] else []
    return DiffusionRequest(
        prompt=f"a red fox {tag} {i}", images=images,
        mask_image=input_mask() if task == "inpainting" else None,
        sampling_params=SamplingParams(
            height=height, width=width, num_inference_steps=steps, seed=i,
            loras={adapter: 1.0} if adapter else None,
            strength=IMAGE_STRENGTH if task in PEER_CLASSES else None,
            cache="first-block" if cached else None))


def _adapters(spec: dict[str, Any]) -> list[str | None]:
    return adapter_traffic(spec["requests"], spec["seed"], spec.get("lora_share", 0.0))


def _caches(spec: dict[str, Any]) -> list[bool]:
    return cache_traffic(spec["requests"], spec["seed"], spec.get("cache_share", 0.0))


def _tasks(spec: dict[str, Any]) -> list[str]:
    if spec.get("edit_share"):
        return edit_traffic(spec["requests"], spec["seed"], spec["edit_share"])
    return image_traffic(spec["requests"], spec["seed"], spec.get("image_share", 0.0))


def _warm_up(spec: dict[str, Any]) -> list[tuple[int, int, str | None, str, bool]]:
    """(height, width, adapter, task, cached) of each warm-up request: every
    size, and every adapter, task and cache choice of the run at least once."""
    adapters = (None, *LORA_NAMES) if spec.get("adapters") else (None,)
    tasks = (TASKS[:3] if spec.get("image_share")
             else (TASKS[0], "editing") if spec.get("edit_share") else TASKS[:1])
    caches = (False, True) if spec.get("cache_share") else (False,)
    n = max(len(SIZES), len(adapters), len(tasks), len(caches))
    return [(*SIZES[i % len(SIZES)], adapters[i % len(adapters)], tasks[i % len(tasks)],
             caches[i % len(caches)]) for i in range(n)]


def _diffrt_run(spec: dict[str, Any], timers: str) -> tuple[list[float], float, dict, list[int]]:
    from diffrt.cli.bench_load import EngineTarget, drive

    mix = traffic(spec["requests"], spec["seed"])
    adapters, tasks, caches = _adapters(spec), _tasks(spec), _caches(spec)
    engine = _engine(spec["system"], timers, spec.get("adapters") or {}, spec.get("threads", 0),
                     model_of(spec), spec.get("mixed_policy"))
    try:
        warm = [_request(i, h, w, 2, "warm", adapter, task, cached)
                for i, (h, w, adapter, task, cached) in enumerate(_warm_up(spec))]
        drive(EngineTarget(engine), warm, concurrency=len(warm), rate=None)
        before = stage_timers.read(timers)  # the worker's totals so far: not measured
        steps_before = dict(engine.stats().cache_steps_total)
        requests = [_request(i, *shape, "r", adapter, task, cached)
                    for i, (shape, adapter, task, cached) in enumerate(zip(
                        mix, adapters, tasks, caches, strict=True))]
        rate = spec.get("rate")
        samples, wall = drive(EngineTarget(engine), requests,
                              concurrency=CONCURRENCY if rate is None else len(requests),
                              rate=rate, seed=spec["seed"])
        steps = {k: n - steps_before.get(k, 0) for k, n in engine.stats().cache_steps_total.items()}
        _note_costs(spec, engine)
    finally:
        engine.close()
    failed = [s.error for s in samples if not s.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    after = stage_timers.read(timers)
    reused = sum(n for (_, outcome), n in steps.items() if outcome == "reused")
    return ([s.latency if s.ok else None for s in samples], wall,
            {k: after[k] - before[k] for k in after}, [reused, sum(steps.values())])


def _note_costs(spec: dict[str, Any], engine: Any) -> None:
    """Append the step-cost model's recent prediction error and the share
    decisions to ``$DIFFRT_BENCH_COSTS`` (a JSON line a run), when set."""
    path = os.environ.get("DIFFRT_BENCH_COSTS")
    if not path:
        return
    share = getattr(engine.scheduler, "share", None)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({
            "system": spec["system"], "rate": spec.get("rate"),
            "error": engine.run_time.online.error(), "coefficients": engine.run_time.coefficients,
            "shared": share.shared if share else None, "split": share.split if share else None,
        }) + "\n")


#: diffusers' First-Block Cache head-block decisions (True: compute), counted
PEER_DECISIONS: list[bool] = []


def _count_peer_decisions() -> None:
    from diffusers.hooks import first_block_cache as fbc

    original = fbc.FBCHeadBlockHook._should_compute_remaining_blocks

    def counted(self: Any, residual: Any) -> bool:
        compute = original(self, residual)
        PEER_DECISIONS.append(bool(compute))
        return compute

    fbc.FBCHeadBlockHook._should_compute_remaining_blocks = counted


def _peer_cache(pipe: Any, cached: bool) -> None:
    """diffusers' First-Block Cache on (the cached requests' calls) or off."""
    from diffusers.hooks import FirstBlockCacheConfig

    transformer = pipe.transformer
    on = getattr(transformer, "bench_cache_on", False)
    if cached and not on:
        transformer.enable_cache(FirstBlockCacheConfig(threshold=pipe.bench_cache_threshold))
    elif on and not cached:
        transformer.disable_cache()
    transformer.bench_cache_on = cached


def _peer_call(pipe: Any, seeds: list[int], height: int, width: int, steps: int,
               adapter: str | None = None, task: str = TASKS[0], cached: bool = False) -> None:
    import contextlib

    import torch

    if getattr(pipe, "bench_loras", False):  # adapters loaded: switch before the call
        if adapter is None:
            pipe.disable_lora()
        else:
            pipe.enable_lora()
            pipe.set_adapters([adapter], [1.0])

    kwargs: dict[str, Any] = {}
    if task in PEER_CLASSES:  # one input per request, as the requests give them
        kwargs = {"image": [input_picture()] * len(seeds), "strength": IMAGE_STRENGTH,
                  # diffrt's Flux guidance (FluxPipeline's default; these two default to 7)
                  "guidance_scale": 3.5}
        if task == "inpainting":
            kwargs["mask_image"] = [input_mask()] * len(seeds)
    if getattr(pipe, "bench_kontext", False):
        # the size asked: FluxKontextPipeline draws max_area (1 Mpx) at the
        # requested aspect, with or without an input image
        kwargs["max_area"] = height * width
        if task == "editing":
            kwargs |= {"image": [input_picture()] * len(seeds), "_auto_resize": False}
    call = pipe.bench_tasks[task] if task != TASKS[0] else pipe
    context: Any = contextlib.nullcontext()
    if getattr(pipe, "bench_cache_threshold", None) is not None:
        _peer_cache(pipe, cached)
        if cached and type(call).__name__ != "FluxPipeline":
            # its pipeline sets no cache_context (FluxPipeline's does, per CFG branch)
            context = pipe.transformer.cache_context("cond")
    with context:
        images = call(prompt=[f"a red fox r {i}" for i in seeds], height=height, width=width,
                      num_inference_steps=steps, output_type="pil",
                      generator=[torch.Generator().manual_seed(i) for i in seeds],
                      **kwargs).images
    assert len(images) == len(seeds) and images[0].size == (width, height), images[0].size


def _peer_run(spec: dict[str, Any]) -> tuple[list[float], float, dict]:
    import diffusers
    import torch

    from diffrt.engine.models.embedded import embedded_folder

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    # the Kontext pipeline draws text-to-image too when given no image
    base = diffusers.FluxKontextPipeline if spec.get("edit_share") else diffusers.FluxPipeline
    pipe = base.from_pretrained(embedded_folder(model_of(spec)), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.bench_kontext = bool(spec.get("edit_share"))
    for name, path in (spec.get("adapters") or {}).items():
        pipe.load_lora_weights(path, adapter_name=name)
        pipe.bench_loras = True
    # the image tasks' pipelines share the base's modules (its LoRA layers too)
    pipe.bench_tasks = ({"editing": pipe} if spec.get("edit_share") else
                        {task: getattr(diffusers, cls).from_pipe(pipe)
                         for task, cls in PEER_CLASSES.items()})
    for other in pipe.bench_tasks.values():
        other.set_progress_bar_config(disable=True)
    if spec.get("cache_share"):
        pipe.bench_cache_threshold = cache_threshold(model_of(spec))
        _count_peer_decisions()
    for h, w, adapter, task, cached in _warm_up(spec):
        _peer_call(pipe, [0], h, w, 2, adapter, task, cached)
    for stage in stage_timers.TOTALS:
        stage_timers.TOTALS[stage] = 0.0
    del PEER_DECISIONS[:]
    mix = traffic(spec["requests"], spec["seed"])
    adapters, kinds, caches = _adapters(spec), _tasks(spec), _caches(spec)
    peer = (SerialPeer(pipe, _peer_call) if spec["system"] == "diffusers serial"
            else StaticBatcherPeer(pipe, _peer_call, MAX_NUM_SEQS, STATIC_WAIT_S))
    rate = spec.get("rate")

    async def main() -> tuple[list[float], float, dict]:
        rng = random.Random(spec["seed"])  # the arrivals bench_load's open loop draws
        gate = asyncio.Semaphore(CONCURRENCY if rate is None else len(mix))
        latencies: list[float | None] = [None] * len(mix)  # None: not finished

        async def one(i: int, height: int, width: int, steps: int) -> None:
            async with gate:
                start = time.perf_counter()
                await peer.run(i, height, width, steps, adapters[i], kinds[i], caches[i])
                latencies[i] = time.perf_counter() - start

        start, tasks = time.perf_counter(), []
        for i, shape in enumerate(mix):
            if i and rate is not None:
                await asyncio.sleep(rng.expovariate(rate))
            tasks.append(asyncio.create_task(one(i, *shape)))
        await asyncio.gather(*tasks)
        return latencies, time.perf_counter() - start, dict(stage_timers.TOTALS)

    latencies, wall, stages = asyncio.run(main())
    return latencies, wall, stages, [PEER_DECISIONS.count(False), len(PEER_DECISIONS)]


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One measure of one system: latencies, wall time, stage seconds, and
    how many requests finished (diffrt: with an image; diffusers: their call
    returned theirs)."""
    with tempfile.TemporaryDirectory() as tmp:
        timers = os.path.join(tmp, "stages.json")
        os.environ["DIFFRT_STAGE_TIMERS"] = timers
        if spec["system"].startswith("diffrt"):
            latencies, wall, stages, cache_steps = _diffrt_run(spec, timers)
        else:
            latencies, wall, stages, cache_steps = _peer_run(spec)
        finished = sum(x is not None for x in latencies)
        return {"latencies": [x if x is not None else float("nan") for x in latencies],
                "wall": wall, "stages": stages, "finished": finished,
                "cache_steps": cache_steps}


def _child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the parent ------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    closed: dict[str, list[dict[str, Any]]] = defaultdict(list)
    opened: dict[str, list[dict[str, Any]]] = defaultdict(list)
    base: dict[str, Any] = {"requests": args.requests, "seed": args.seed,
                            "threads": args.torch_threads, "mixed_policy": args.mixed_policy}
    if args.lora_share:
        base |= {"lora_share": args.lora_share, "adapters": args.adapter_paths}
    if args.image_share:
        base["image_share"] = args.image_share
    if args.edit_share:
        base["edit_share"] = args.edit_share
    if args.cache_share:
        base["cache_share"] = args.cache_share
    systems = systems_of(args)
    for rnd in range(args.rounds):
        order = list(systems[rnd % len(systems):] + systems[:rnd % len(systems)])
        for system in order:
            closed[system].append(_child({**base, "system": system}, args.child_timeout))
        keyed = closed["diffrt keyed"][-1]
        rate = args.load * args.requests / keyed["wall"]
        for system in order:
            opened[system].append(_child({**base, "system": system, "rate": rate},
                                         args.child_timeout))
        print(f"  round {rnd + 1}/{args.rounds} done (open loop at {rate:.2f} req/s)",
              file=sys.stderr, flush=True)
    return {"closed": closed, "open": opened}


def report(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    rows: dict[str, dict[str, float]] = {}
    systems = systems_of(args)
    for system in systems:
        runs = results["closed"][system]
        stages = {s: median([r["stages"][s] for r in runs]) for s in ("transformer", "vae", "text")}
        wall = median([r["wall"] for r in runs])
        lats = results["open"][system]
        rows[system] = {
            "rps": args.requests / wall, "wall_s": wall,
            "transformer_rps": args.requests / stages["transformer"] if stages["transformer"] else 0.0,
            **{f"{s}_share": stages[s] / wall for s in stages},
            "p50_s": median([percentile(r["latencies"], 50) for r in lats]),
            "p99_s": median([percentile(r["latencies"], 99) for r in lats]),
        }
    print(f"\n== mixed traffic: {model_of(vars(args))}, {args.requests} requests, sizes "
          f"{', '.join(f'{h}x{w}' for h, w in SIZES)}, steps {STEPS}; median of {args.rounds} "
          f"round(s), each system in a fresh process ==")
    if args.lora_share:
        adapters = adapter_traffic(args.requests, args.seed, args.lora_share)
        print(f"adapters: --lora-share {args.lora_share:g}: "
              + ", ".join(f"{a or 'none'} {adapters.count(a)}" for a in (None, *LORA_NAMES))
              + " (rank 8)")
    if args.image_share:
        tasks = image_traffic(args.requests, args.seed, args.image_share)
        print(f"input images: --image-share {args.image_share:g}: "
              + ", ".join(f"{t} {tasks.count(t)}" for t in TASKS[:3])
              + f" (strength {IMAGE_STRENGTH:g})")
    if args.edit_share:
        tasks = edit_traffic(args.requests, args.seed, args.edit_share)
        print(f"edits (FLUX.1 Kontext): --edit-share {args.edit_share:g}: "
              + ", ".join(f"{t} {tasks.count(t)}" for t in (TASKS[0], "editing")))
    if args.cache_share:
        cached = cache_traffic(args.requests, args.seed, args.cache_share)
        print(f"step cache: --cache-share {args.cache_share:g}: first-block {sum(cached)}, none "
              f"{len(cached) - sum(cached)} (threshold {cache_threshold(model_of(vars(args))):g}, "
              "the model's default); diffusers: its FirstBlockCacheConfig at the same threshold "
              "on those requests' calls, decided per call (a batch's rows together, each CFG "
              "branch apart)")
    if args.torch_threads:
        print(f"torch threads of every system: {args.torch_threads}")
    if args.mixed_policy:
        print(f"diffrt mixed's scheduling policy: {args.mixed_policy}")
    print(f"closed loop at concurrency {CONCURRENCY}; open loop: Poisson at "
          f"{args.load:.0%} of diffrt keyed's closed-loop capacity")
    head = (f"{'system':<18}{'req/s':>8}{'xformer req/s':>15}{'xformer':>9}{'vae':>7}"
            f"{'text':>7}{'p50 s':>9}{'p99 s':>9}")
    print(head)
    for system, r in rows.items():
        print(f"{system:<18}{r['rps']:>8.2f}{r['transformer_rps']:>15.2f}"
              f"{r['transformer_share']:>9.0%}{r['vae_share']:>7.0%}{r['text_share']:>7.0%}"
              f"{r['p50_s']:>9.2f}{r['p99_s']:>9.2f}")
    mixed, keyed = rows["diffrt mixed"], rows["diffrt keyed"]
    goals = [
        ("transformer throughput, mixed / keyed", mixed["transformer_rps"] / keyed["transformer_rps"],
         ">= 1.4"),
        ("end-to-end throughput, mixed / keyed", mixed["rps"] / keyed["rps"], ">= 1.1"),
        ("p99, mixed / keyed", mixed["p99_s"] / keyed["p99_s"], "<= 0.7"),
    ]
    if not args.diffrt_only:
        peer = max(PEERS, key=lambda s: rows[s]["rps"])
        tail_peer = min(PEERS, key=lambda s: rows[s]["p99_s"])
        goals[2:2] = [(f"end-to-end throughput, mixed / {peer}", mixed["rps"] / rows[peer]["rps"],
                       ">= 2")]
        goals.append((f"p99, mixed / {tail_peer}", mixed["p99_s"] / rows[tail_peer]["p99_s"],
                      "<= 0.3"))
    print()
    for name, value, goal in goals:
        print(f"{name:<48}{value:>7.2f}   (goal {goal})")
    per_task = report_tasks(results, args) if args.image_share or args.edit_share else {}
    if args.cache_share:
        print("\nsteps the cached requests reused (closed and open loop runs together; "
              "diffusers: head-block decisions, one per call and CFG branch):")
        for system in systems:
            runs = results["closed"][system] + results["open"][system]
            reused = sum(r["cache_steps"][0] for r in runs)
            total = sum(r["cache_steps"][1] for r in runs)
            rows[system]["cache_reused_share"] = reused / total if total else 0.0
            print(f"  {system:<18}{reused:>7} of {total:<7} ({reused / total if total else 0:.0%})")
    runs = [(system, r) for measure in ("closed", "open") for system in systems
            for r in results[measure][system]]
    short = [f"{system} {r['finished']}/{args.requests}" for system, r in runs
             if r["finished"] != args.requests]
    print(f"\nrequests finished: {'all ' + str(args.requests) if not short else ', '.join(short)}"
          f" in each of the {len(runs)} runs ({args.rounds} round(s) x closed and open loop x "
          f"{len(systems)} systems)")
    return {"systems": rows, "ratios": {name: value for name, value, _ in goals},
            "lora_share": args.lora_share, "image_share": args.image_share,
            "edit_share": args.edit_share, "cache_share": args.cache_share,
            "tasks": per_task, "all_finished": not short}


def report_tasks(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Each task's open-loop p50 and p99 per system (medians over the rounds)."""
    tasks = _tasks(vars(args))
    present = [t for t in TASKS if t in tasks]
    figures: dict[str, Any] = {}
    print("\nopen loop by task (median over rounds of each task's percentile): "
          + ", ".join(f"{t} {tasks.count(t)}" for t in present))
    print(f"{'system':<18}" + "".join(f"{t + ' p50/p99 s':>32}" for t in present))
    for system in systems_of(args):
        runs = results["open"][system]
        figures[system] = {}
        for task in present:
            of_task = [[lat for lat, t in zip(r["latencies"], tasks, strict=True) if t == task]
                       for r in runs]
            figures[system][task] = {"p50_s": median([percentile(x, 50) for x in of_task]),
                                     "p99_s": median([percentile(x, 99) for x in of_task])}
        print(f"{system:<18}" + "".join(
            f"{figures[system][t]['p50_s']:>22.2f} /{figures[system][t]['p99_s']:>8.2f}"
            for t in present))
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="48 requests, 1 round")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lora-share", type=float, default=0.0, metavar="S",
                    help="this share of the requests names a LoRA adapter (A, B or C)")
    ap.add_argument("--image-share", type=float, default=0.0, metavar="S",
                    help="this share of the requests gives an input image (half of them a "
                         "mask too): image-to-image and inpainting")
    ap.add_argument("--edit-share", type=float, default=0.0, metavar="S",
                    help="run on tiny-flux-kontext; this share of the requests edits an "
                         "input image (FLUX.1 Kontext)")
    ap.add_argument("--cache-share", type=float, default=0.0, metavar="S",
                    help="this share of the requests asks for the first-block step cache "
                         "(the model's default threshold); diffusers runs them with its "
                         "FirstBlockCache")
    ap.add_argument("--torch-threads", type=int, default=0, metavar="N",
                    help="torch threads of every system (default: the engine's choice, "
                         "torch's default for diffusers)")
    ap.add_argument("--mixed-policy", choices=("fifo", "skip_ahead", "slo"),
                    help="diffrt mixed's scheduling policy (default: the engine's, fifo); "
                         "skip_ahead compares mixing alone with the keyed engine")
    ap.add_argument("--diffrt-only", action="store_true",
                    help="measure diffrt mixed and keyed only (no diffusers peers)")
    ap.add_argument("--slo", action="store_true",
                    help="priorities and deadlines: two priority classes at 80 %% and 110 %% "
                         "of the closed-loop capacity each policy's process measures, under "
                         "fifo, skip_ahead and slo (bench_slo.py)")
    ap.add_argument("--slo-requests", type=int, default=300, metavar="N",
                    help="--slo: requests a load point")
    ap.add_argument("--slo-rounds", type=int, default=1, metavar="R",
                    help="--slo: rounds (the policies' order rotates; medians over rounds)")
    ap.add_argument("--slo-mix", choices=("images", "video"), default="images",
                    help="--slo: tiny-flux interactive and batch images (default), or tiny-wan "
                         "one-frame images (priority 0) beside clips (priority 5)")
    ap.add_argument("--slo-aging-ticks", type=bench_slo.aging_ticks, metavar="N[,M...]",
                    help="--slo: run the slo policy once for each of these slo_aging_ticks, "
                         "rows slo@N in place of the slo row (default: one slo row at the "
                         "engine's value)")
    ap.add_argument("--slo-child", metavar="SPEC", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the table's figures here")
    ap.add_argument("--child-timeout", type=float, default=1200)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.slo_child:
        print(json.dumps(bench_slo.child(json.loads(args.slo_child))))
        return 0
    if args.slo:
        start = time.perf_counter()
        figures = bench_slo.run_slo(args)
        print(f"\n(whole run {time.perf_counter() - start:.0f} s)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f, indent=2)
        return 0
    if args.quick:
        args.requests, args.rounds = 48, 1
    if not 0.0 <= args.lora_share <= 1.0:
        ap.error("--lora-share is a share: 0 to 1")
    if not 0.0 <= args.image_share <= 1.0:
        ap.error("--image-share is a share: 0 to 1")
    if not 0.0 <= args.edit_share <= 1.0:
        ap.error("--edit-share is a share: 0 to 1")
    if not 0.0 <= args.cache_share <= 1.0:
        ap.error("--cache-share is a share: 0 to 1")
    if args.edit_share and (args.image_share or args.lora_share):
        ap.error("--edit-share runs on tiny-flux-kontext, which serves no image-to-image, "
                 "and the adapters are made on tiny-flux: not with --image-share or "
                 "--lora-share")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="diffrt-bench-mixed-") as work:
        args.adapter_paths = {}
        if args.lora_share:
            from bench_lora import make_adapters

            from diffrt.engine.models.embedded import embedded_folder

            args.adapter_paths = make_adapters(str(embedded_folder("tiny-flux")),
                                               Path(work) / "adapters")
        figures = report(run(args), args)
    print(f"\n(whole run {time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


import bench_slo  # noqa: E402  (after HERE is on sys.path)
import stage_timers  # noqa: E402
from diffusers_peers import SerialPeer, StaticBatcherPeer  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
