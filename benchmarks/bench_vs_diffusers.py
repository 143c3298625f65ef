"""diffrt against what a user runs without it: diffusers' own FluxPipeline.

Both load the same complete model folder (the embedded ``tiny-flux``: the
peer encodes its prompts with the folder's CLIP and T5 too) and return PIL
images. Printed, never asserted. Run from the repository root:

    .venv/bin/python benchmarks/bench_vs_diffusers.py            # full run (~30 min here)
    .venv/bin/python benchmarks/bench_vs_diffusers.py --quick    # a few minutes

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

THROUGHPUT_SYSTEMS = ["diffusers serial", "diffusers batch 8", "diffrt serial",
                      "diffrt step x8", "diffrt request x8"]
LATENCY_SYSTEMS = ["diffrt step x8", "diffusers serial", "diffusers static batcher"]
MIX_SIZES = (64, 256, 512)
MIX_STEPS = (4, 8, 28)


# -- the systems, each in its own process ---------------------------------------------------
def _peer_pipeline() -> Any:
    import torch
    from diffusers import FluxPipeline

    from diffrt.engine.pipelines.embedded import embedded_folder

    pipe = FluxPipeline.from_pretrained(embedded_folder("tiny-flux"), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _peer_call(pipe: Any, prompts: list[str], size: int, steps: int, seed: int) -> list[Any]:
    import torch

    return pipe(prompt=prompts, height=size, width=size, num_inference_steps=steps,
                generator=torch.Generator().manual_seed(seed), output_type="pil").images


def _engine(system: str, extra: dict[str, Any]) -> Any:
    from diffrt.engine import DiffusionEngine, EngineConfig

    step = "step" in system
    seqs = 1 if "serial" in system else 8
    return DiffusionEngine.make_engine(EngineConfig(
        model="tiny-flux", step_execution=step, max_num_seqs=seqs, **extra))


def _request(i: int, size: int, steps: int, tag: str) -> Any:
    from diffrt.engine import DiffusionRequest, SamplingParams

    return DiffusionRequest(prompt=f"a red fox {i}", request_id=f"{tag}-{i}",
                            sampling_params=SamplingParams(height=size, width=size,
                                                           num_inference_steps=steps, seed=i))


def throughput_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Images per second of one system at one size (warm-up excluded)."""
    system, size, steps, n = spec["system"], spec["size"], spec["steps"], spec["requests"]
    if system.startswith("diffusers"):
        pipe = _peer_pipeline()
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

        engine = _engine(system, spec.get("engine", {}))
        try:
            concurrency = 1 if "serial" in system else 8
            warm = [_request(i, size, steps, "warm") for i in range(concurrency)]
            drive(EngineTarget(engine), warm, concurrency=concurrency, rate=None)
            samples, wall = drive(EngineTarget(engine),
                                  [_request(i, size, steps, "r") for i in range(n)],
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

        engine = _engine("diffrt step x8", spec.get("engine", {}))
        try:
            reqs = [_request(i, s, st, "cap") for i, (s, st) in enumerate(mix)]
            drive(EngineTarget(engine), reqs[:8], concurrency=8, rate=None)
            samples, wall = drive(EngineTarget(engine), reqs, concurrency=8, rate=None)
        finally:
            engine.close()
        return {"requests_per_s": len(samples) / wall}
    rate = spec["rate"]
    if system.startswith("diffrt"):
        from diffrt.cli.bench_load import EngineTarget, drive

        engine = _engine(system, spec.get("engine", {}))
        try:
            drive(EngineTarget(engine), [_request(i, 64, 4, "warm") for i in range(2)],
                  concurrency=2, rate=None)
            samples, _ = drive(EngineTarget(engine),
                               [_request(i, s, st, "lat") for i, (s, st) in enumerate(mix)],
                               concurrency=len(mix), rate=rate, seed=spec["seed"])
        finally:
            engine.close()
        if not all(s.ok for s in samples):
            raise RuntimeError("a request failed")
        return {"latencies": [s.latency for s in samples]}
    from diffusers_peers import SerialPeer, StaticBatcherPeer

    pipe = _peer_pipeline()
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


def bench_throughput(args: argparse.Namespace) -> None:
    print(f"\n== throughput: images/s, tiny-flux, {args.steps} steps, {args.requests} requests, "
          f"median of {args.rounds} interleaved rounds, each in a fresh process ==")
    results: dict[tuple[str, int], list[float]] = defaultdict(list)
    for rnd in range(args.rounds):
        for size in args.sizes:
            systems = [x for x in THROUGHPUT_SYSTEMS if x in args.systems]
            k = rnd % len(systems)
            order = systems[k:] + systems[:k]
            for system in order:
                spec = {"system": system, "size": size, "steps": args.steps,
                        "requests": args.requests, "engine": args.engine}
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


def bench_latency(args: argparse.Namespace) -> None:
    print(f"\n== latency: {args.latency_requests} requests, (size, steps) uniform over "
          f"{MIX_SIZES} x {MIX_STEPS}, Poisson arrivals ==")
    base = {"requests": args.latency_requests, "seed": args.seed, "engine": args.engine}
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
    ap.add_argument("--sizes", type=int, nargs="*", default=[64, 256, 512])
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

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; diffrt engine extras: "
          f"{args.engine or 'none'}; diffusers with diffrt's allocator setting: "
          f"{'yes' if PEER_ENV else 'no'}")
    if not args.skip_throughput:
        bench_throughput(args)
    if not args.skip_latency:
        bench_latency(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
