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

Adapter traffic (``--lora-share S``): a share S of the requests (seeded,
drawn apart from the shapes, so the shapes stay those above) names one of
three rank-8 LoRA adapters A, B, C (``bench_lora.py``'s, made offline on
tiny-flux), uniformly. diffrt registers them (``lora_modules``) and serves
any mix of them in one step; ``diffrt keyed`` keys by size only, as before.
diffusers switches with ``set_adapters`` (``disable_lora`` for a request
without one) before each call; its static batcher groups by
(size, steps, adapter). Without the option nothing changes. Run from the
repository root:

    .venv/bin/python benchmarks/bench_mixed_traffic.py            # 200 requests, 2 rounds
    .venv/bin/python benchmarks/bench_mixed_traffic.py --quick    # 48 requests, 1 round
    .venv/bin/python benchmarks/bench_mixed_traffic.py --quick --lora-share 0.5
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
CONCURRENCY = 16
MAX_NUM_SEQS = 16
STATIC_WAIT_S = 2.0
LORA_NAMES = ("A", "B", "C")


def traffic(n: int, seed: int) -> list[tuple[int, int, int]]:
    """(height, width, steps) of each request."""
    rng = random.Random(seed)
    return [(*rng.choice(SIZES), rng.choice(STEPS)) for _ in range(n)]


def adapter_traffic(n: int, seed: int, share: float) -> list[str | None]:
    """Each request's adapter (None: none): a share ``share`` of them, uniform
    over A, B, C; drawn from their own generator (the shapes stay as they were)."""
    rng = random.Random(f"lora {seed}")
    return [rng.choice(LORA_NAMES) if rng.random() < share else None for _ in range(n)]


# -- one system in a fresh process ---------------------------------------------------------------
def _engine(system: str, timers: str, adapters: dict[str, str]) -> Any:
    from diffrt.engine import DiffusionEngine, EngineConfig

    extra: dict[str, Any] = {}
    if system == "diffrt keyed":
        extra = {"mixed_size_batching": False, "scheduling_policy": "skip_ahead"}
    if adapters:
        extra |= {"lora_modules": adapters, "max_loras": len(adapters) + 1}
    path = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
    return DiffusionEngine.make_engine(EngineConfig(
        model="tiny-flux", step_execution=True, max_num_seqs=MAX_NUM_SEQS,
        plugin_modules=("stage_timers",),
        worker_env={"PYTHONPATH": path, "DIFFRT_STAGE_TIMERS": timers}, **extra))


def _request(i: int, height: int, width: int, steps: int, tag: str,
             adapter: str | None = None) -> Any:
    from diffrt.engine import DiffusionRequest, SamplingParams

    return DiffusionRequest(prompt=f"a red fox {tag} {i}", sampling_params=SamplingParams(
        height=height, width=width, num_inference_steps=steps, seed=i,
        loras={adapter: 1.0} if adapter else None))


def _adapters(spec: dict[str, Any]) -> list[str | None]:
    return adapter_traffic(spec["requests"], spec["seed"], spec.get("lora_share", 0.0))


def _diffrt_run(spec: dict[str, Any], timers: str) -> tuple[list[float], float, dict]:
    from diffrt.cli.bench_load import EngineTarget, drive

    mix = traffic(spec["requests"], spec["seed"])
    adapters = _adapters(spec)
    engine = _engine(spec["system"], timers, spec.get("adapters") or {})
    try:
        warm_adapters = (None, *LORA_NAMES) if spec.get("adapters") else (None,)
        warm = [_request(i, h, w, 2, "warm", warm_adapters[i % len(warm_adapters)])
                for i, (h, w) in enumerate(SIZES)]
        drive(EngineTarget(engine), warm, concurrency=len(warm), rate=None)
        before = stage_timers.read(timers)  # the worker's totals so far: not measured
        requests = [_request(i, *shape, "r", adapter)
                    for i, (shape, adapter) in enumerate(zip(mix, adapters, strict=True))]
        rate = spec.get("rate")
        samples, wall = drive(EngineTarget(engine), requests,
                              concurrency=CONCURRENCY if rate is None else len(requests),
                              rate=rate, seed=spec["seed"])
    finally:
        engine.close()
    failed = [s.error for s in samples if not s.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    after = stage_timers.read(timers)
    return [s.latency for s in samples], wall, {k: after[k] - before[k] for k in after}


def _peer_call(pipe: Any, seeds: list[int], height: int, width: int, steps: int,
               adapter: str | None = None) -> None:
    import torch

    if getattr(pipe, "bench_loras", False):  # adapters loaded: switch before the call
        if adapter is None:
            pipe.disable_lora()
        else:
            pipe.enable_lora()
            pipe.set_adapters([adapter], [1.0])

    images = pipe(prompt=[f"a red fox r {i}" for i in seeds], height=height, width=width,
                  num_inference_steps=steps, output_type="pil",
                  generator=[torch.Generator().manual_seed(i) for i in seeds]).images
    assert len(images) == len(seeds)


def _peer_run(spec: dict[str, Any]) -> tuple[list[float], float, dict]:
    import torch
    from diffusers import FluxPipeline

    from diffrt.engine.pipelines.embedded import embedded_folder

    pipe = FluxPipeline.from_pretrained(embedded_folder("tiny-flux"), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    for name, path in (spec.get("adapters") or {}).items():
        pipe.load_lora_weights(path, adapter_name=name)
        pipe.bench_loras = True
    warm_adapters = (None, *LORA_NAMES) if spec.get("adapters") else (None,)
    for i, (h, w) in enumerate(SIZES):
        _peer_call(pipe, [0], h, w, 2, warm_adapters[i % len(warm_adapters)])
    for stage in stage_timers.TOTALS:
        stage_timers.TOTALS[stage] = 0.0
    mix = traffic(spec["requests"], spec["seed"])
    adapters = _adapters(spec)
    peer = (SerialPeer(pipe, _peer_call) if spec["system"] == "diffusers serial"
            else StaticBatcherPeer(pipe, _peer_call, MAX_NUM_SEQS, STATIC_WAIT_S))
    rate = spec.get("rate")

    async def main() -> tuple[list[float], float, dict]:
        rng = random.Random(spec["seed"])  # the arrivals bench_load's open loop draws
        gate = asyncio.Semaphore(CONCURRENCY if rate is None else len(mix))
        latencies = [0.0] * len(mix)

        async def one(i: int, height: int, width: int, steps: int) -> None:
            async with gate:
                start = time.perf_counter()
                await peer.run(i, height, width, steps, adapters[i])
                latencies[i] = time.perf_counter() - start

        start, tasks = time.perf_counter(), []
        for i, shape in enumerate(mix):
            if i and rate is not None:
                await asyncio.sleep(rng.expovariate(rate))
            tasks.append(asyncio.create_task(one(i, *shape)))
        await asyncio.gather(*tasks)
        return latencies, time.perf_counter() - start, dict(stage_timers.TOTALS)

    return asyncio.run(main())


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One measure of one system: latencies, wall time, stage seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        timers = os.path.join(tmp, "stages.json")
        os.environ["DIFFRT_STAGE_TIMERS"] = timers
        if spec["system"].startswith("diffrt"):
            latencies, wall, stages = _diffrt_run(spec, timers)
        else:
            latencies, wall, stages = _peer_run(spec)
        return {"latencies": latencies, "wall": wall, "stages": stages}


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
    base: dict[str, Any] = {"requests": args.requests, "seed": args.seed}
    if args.lora_share:
        base |= {"lora_share": args.lora_share, "adapters": args.adapter_paths}
    for rnd in range(args.rounds):
        order = list(SYSTEMS[rnd % len(SYSTEMS):] + SYSTEMS[:rnd % len(SYSTEMS)])
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
    for system in SYSTEMS:
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
    print(f"\n== mixed traffic: tiny-flux, {args.requests} requests, sizes "
          f"{', '.join(f'{h}x{w}' for h, w in SIZES)}, steps {STEPS}; median of {args.rounds} "
          f"round(s), each system in a fresh process ==")
    if args.lora_share:
        adapters = adapter_traffic(args.requests, args.seed, args.lora_share)
        print(f"adapters: --lora-share {args.lora_share:g}: "
              + ", ".join(f"{a or 'none'} {adapters.count(a)}" for a in (None, *LORA_NAMES))
              + " (rank 8)")
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
    peer = max(("diffusers serial", "diffusers static"), key=lambda s: rows[s]["rps"])
    tail_peer = min(("diffusers serial", "diffusers static"), key=lambda s: rows[s]["p99_s"])
    goals = [
        ("transformer throughput, mixed / keyed", mixed["transformer_rps"] / keyed["transformer_rps"],
         ">= 1.4"),
        ("end-to-end throughput, mixed / keyed", mixed["rps"] / keyed["rps"], ">= 1.1"),
        (f"end-to-end throughput, mixed / {peer}", mixed["rps"] / rows[peer]["rps"], ">= 2"),
        ("p99, mixed / keyed", mixed["p99_s"] / keyed["p99_s"], "<= 0.7"),
        (f"p99, mixed / {tail_peer}", mixed["p99_s"] / rows[tail_peer]["p99_s"], "<= 0.3"),
    ]
    print()
    for name, value, goal in goals:
        print(f"{name:<48}{value:>7.2f}   (goal {goal})")
    return {"systems": rows, "ratios": {name: value for name, value, _ in goals},
            "lora_share": args.lora_share}


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
    ap.add_argument("--json", help="also write the table's figures here")
    ap.add_argument("--child-timeout", type=float, default=1200)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.quick:
        args.requests, args.rounds = 48, 1
    if not 0.0 <= args.lora_share <= 1.0:
        ap.error("--lora-share is a share: 0 to 1")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="diffrt-bench-mixed-") as work:
        args.adapter_paths = {}
        if args.lora_share:
            from bench_lora import make_adapters

            from diffrt.engine.pipelines.embedded import embedded_folder

            args.adapter_paths = make_adapters(str(embedded_folder("tiny-flux")),
                                               Path(work) / "adapters")
        figures = report(run(args), args)
    print(f"\n(whole run {time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


import stage_timers  # noqa: E402  (after HERE is on sys.path)
from diffusers_peers import SerialPeer, StaticBatcherPeer  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
