"""LoRA adapters per request: one batch for every adapter set, or one per set, or diffusers.

32 requests at concurrency 8, 128x128, 8 steps, each with an adapter drawn
uniformly (seeded) from {none, A, B, C} (rank 8, different seeds and target
sets), on two models:

- ``tiny-flux``, the embedded tiny Flux folder (its linears are 32 wide: as
  small as the adapters, so an adapter costs relatively much there);
- ``flux-width``, the same folder with its transformer replaced by a seeded
  random ``FluxTransformer2DModel`` of Flux's head size (8 heads x 128 =
  1024 hidden, 1 double + 1 single block, as ``diffrt env --check`` builds
  one), where a rank-8 adapter costs what it costs on a real model
  (8 x (in + out) multiply-adds per token and layer against in x out: 1.6 % at 1024).

Four arms, each in a fresh process, rounds interleaved (the order rotates),
medians printed with ratios; nothing asserted:

- ``mixed``: step mode, ``max_num_seqs=8``, the adapters registered
  (``lora_modules``, ``max_loras=4``); requests of any adapter set, or none,
  share each step (the default);
- ``equal-sets``: the same engine whose step batch key also holds the
  request's adapter set, with the ``skip_ahead`` policy: only requests of
  equal adapter sets share a step (what an engine that merges adapters, or
  keys batches by them, does at best);
- ``no-adapter``: the mixed engine and traffic with every request's
  adapters dropped (the cost of the adapters themselves);
- ``diffusers``: diffusers' ``FluxPipeline`` from the same folder with
  A, B, C loaded (``load_lora_weights``), the requests one at a time in the
  measuring process, switching with ``set_adapters([name], [1.0])`` or
  ``disable_lora()`` before each call.

The engine arms run diffrt's default multiprocess executor (one CPU worker,
the threads it chooses). Run from the repository root:

    .venv/bin/python benchmarks/bench_lora.py                       # 32 requests, 3 rounds
    .venv/bin/python benchmarks/bench_lora.py --requests 16 --rounds 1 --models tiny-flux
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from diffrt.cli.bench_stats import median, percentile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

ARMS = ("mixed", "equal-sets", "no-adapter", "diffusers")
MODELS = ("tiny-flux", "flux-width")
ADAPTER_CHOICES = (None, "A", "B", "C")
SIZE = 128
STEPS = 8
CONCURRENCY = 8
MAX_NUM_SEQS = 8
RANK = 8
ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")
#: each adapter's seed and target modules (PEFT suffixes)
ADAPTERS: dict[str, tuple[int, tuple[str, ...]]] = {
    "A": (1, ATTENTION),
    "B": (2, ATTENTION + ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")),
    "C": (3, ATTENTION + ("ff.net.0.proj", "ff.net.2", "proj_mlp", "proj_out")),
}
#: the Flux-width transformer: Flux's head size and rope axes, 2 blocks
FLUX_WIDTH = dict(num_attention_heads=8, attention_head_dim=128, axes_dims_rope=(16, 56, 56),
                  num_layers=1, num_single_layers=1)


def traffic(n: int, seed: int) -> list[str | None]:
    """Each request's adapter (None: no adapter)."""
    rng = random.Random(seed)
    return [rng.choice(ADAPTER_CHOICES) for _ in range(n)]


# -- the model folders and adapters (the parent, offline) ----------------------------------
def flux_width_folder(out: Path) -> Path:
    """tiny-flux's folder (text encoders, tokenizers, VAE, scheduler) with a
    seeded random Flux-width transformer whose inputs fit them."""
    from diffusers import FluxTransformer2DModel

    from diffrt.engine.models.embedded import embedded_folder
    from diffrt.engine.models.tiny import shared

    tiny = Path(embedded_folder("tiny-flux"))
    shutil.copytree(tiny, out, ignore=lambda d, names: ["transformer"] if Path(d) == tiny else [])
    tiny_config = json.loads((tiny / "transformer" / "config.json").read_text())
    keep = ("patch_size", "in_channels", "joint_attention_dim", "pooled_projection_dim",
            "guidance_embeds")
    shared.save_seeded(out / "transformer", FluxTransformer2DModel, 0,
                       **{k: tiny_config[k] for k in keep}, **FLUX_WIDTH)
    return out


def make_adapters(folder: str, out: Path) -> dict[str, str]:
    sys.path.insert(0, os.path.join(ROOT, "tests", "engine"))
    from lora_files import make_adapter  # the tests' offline adapter maker

    return {name: make_adapter(folder, "FluxPipeline", out / name, targets=targets, rank=RANK,
                               seed=seed)
            for name, (seed, targets) in ADAPTERS.items()}


def prepare(models: tuple[str, ...], work: Path) -> dict[str, dict[str, Any]]:
    """model -> {"folder", "adapters"}."""
    from diffrt.engine.models.embedded import embedded_folder

    prepared = {}
    for model in models:
        folder = (str(embedded_folder("tiny-flux")) if model == "tiny-flux"
                  else str(flux_width_folder(work / model)))
        prepared[model] = {"folder": folder,
                           "adapters": make_adapters(folder, work / f"{model}-adapters")}
    return prepared


# -- one arm in a fresh process -------------------------------------------------------------
def _step_keyed_by_adapters(base: Any) -> Any:
    def key(request: Any) -> tuple:
        loras = request.sampling_params.loras or {}
        return (base(request), tuple(sorted(loras.items())))

    return key


def _engine(spec: dict[str, Any]) -> Any:
    from diffrt.engine import DiffusionEngine, EngineConfig

    class EqualSetsEngine(DiffusionEngine):
        """Only requests of equal adapter sets share a step."""

        def _step_batch_key(self) -> Any:
            return _step_keyed_by_adapters(super()._step_batch_key())

    extra: dict[str, Any] = {"torch_threads": spec["threads"]} if spec.get("threads") else {}
    cls = DiffusionEngine
    if spec["arm"] == "equal-sets":
        cls = EqualSetsEngine
        extra["scheduling_policy"] = "skip_ahead"
    return cls.make_engine(EngineConfig(
        model=spec["folder"], step_execution=True, max_num_seqs=MAX_NUM_SEQS,
        lora_modules=spec["adapters"], max_loras=4, **extra))


def _request(i: int, adapter: str | None, steps: int, tag: str) -> Any:
    from diffrt.engine import DiffusionRequest, SamplingParams

    return DiffusionRequest(prompt=f"a red fox {tag} {i}", sampling_params=SamplingParams(
        height=SIZE, width=SIZE, num_inference_steps=steps, seed=i,
        loras={adapter: 1.0} if adapter else None))


def _engine_run(spec: dict[str, Any]) -> tuple[list[float], float]:
    from diffrt.cli.bench_load import EngineTarget, drive

    mix = traffic(spec["requests"], spec["seed"])
    if spec["arm"] == "no-adapter":
        mix = [None] * len(mix)
    engine = _engine(spec)
    try:
        # every adapter set, in a full batch: slots filled, batch shapes seen
        warm = [_request(i, ADAPTER_CHOICES[i % len(ADAPTER_CHOICES)], 2, "warm")
                for i in range(MAX_NUM_SEQS)]
        drive(EngineTarget(engine), warm, concurrency=len(warm), rate=None)
        requests = [_request(i, a, STEPS, "r") for i, a in enumerate(mix)]
        samples, wall = drive(EngineTarget(engine), requests, concurrency=CONCURRENCY,
                              rate=None)
    finally:
        engine.close()
    failed = [s.error for s in samples if not s.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    return [s.latency for s in samples], wall


def _peer_run(spec: dict[str, Any]) -> tuple[list[float], float]:
    import torch
    from diffusers import FluxPipeline

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    pipe = FluxPipeline.from_pretrained(spec["folder"], torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    for name, path in spec["adapters"].items():
        pipe.load_lora_weights(path, adapter_name=name)

    def call(i: int, adapter: str | None, steps: int, tag: str) -> None:
        if adapter is None:
            pipe.disable_lora()
        else:
            pipe.enable_lora()
            pipe.set_adapters([adapter], [1.0])
        images = pipe(prompt=f"a red fox {tag} {i}", height=SIZE, width=SIZE,
                      num_inference_steps=steps, output_type="pil",
                      generator=torch.Generator().manual_seed(i)).images
        assert len(images) == 1

    for i, adapter in enumerate(ADAPTER_CHOICES):
        call(i, adapter, 2, "warm")
    mix = traffic(spec["requests"], spec["seed"])

    async def main() -> tuple[list[float], float]:
        lock = asyncio.Lock()  # one request at a time, in arrival order
        gate = asyncio.Semaphore(CONCURRENCY)
        latencies = [0.0] * len(mix)

        async def one(i: int, adapter: str | None) -> None:
            async with gate:
                start = time.perf_counter()
                async with lock:
                    await asyncio.to_thread(call, i, adapter, STEPS, "r")
                latencies[i] = time.perf_counter() - start

        start = time.perf_counter()
        await asyncio.gather(*(one(i, a) for i, a in enumerate(mix)))
        return latencies, time.perf_counter() - start

    return asyncio.run(main())


def child(spec: dict[str, Any]) -> dict[str, Any]:
    latencies, wall = _peer_run(spec) if spec["arm"] == "diffusers" else _engine_run(spec)
    return {"latencies": latencies, "wall": wall}


def _child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--arm", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['model']} {spec['arm']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the parent ------------------------------------------------------------------------------
def run(args: argparse.Namespace, prepared: dict[str, dict[str, Any]]) -> dict[str, Any]:
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        m: defaultdict(list) for m in prepared}
    for rnd in range(args.rounds):
        order = ARMS[rnd % len(ARMS):] + ARMS[:rnd % len(ARMS)]
        for model, paths in prepared.items():
            for arm in order:
                spec = {"model": model, "arm": arm, "requests": args.requests,
                        "seed": args.seed, "threads": args.torch_threads, **paths}
                results[model][arm].append(_child(spec, args.child_timeout))
                print(f"  round {rnd + 1}/{args.rounds} {model} {arm}: "
                      f"{results[model][arm][-1]['wall']:.1f} s", file=sys.stderr, flush=True)
    return results


def report(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    mix = traffic(args.requests, args.seed)
    shares = ", ".join(f"{a or 'none'} {mix.count(a)}" for a in ADAPTER_CHOICES)
    print(f"\n== LoRA per request: {args.requests} requests at concurrency {CONCURRENCY}, "
          f"{SIZE}x{SIZE}, {STEPS} steps, rank-{RANK} adapters drawn from "
          f"{{none, A, B, C}} ({shares}); median of {args.rounds} round(s), each arm in a "
          f"fresh process"
          + (f", {args.torch_threads} torch thread(s)" if args.torch_threads else "") + " ==\n")
    print("| model | arm | req/s | p50 s | p99 s |")
    print("|---|---|---:|---:|---:|")
    figures: dict[str, Any] = {}
    for model, arms in results.items():
        rows = {}
        for arm in ARMS:
            runs = arms[arm]
            wall = median([r["wall"] for r in runs])
            rows[arm] = {"rps": args.requests / wall, "wall_s": wall,
                         "round_walls_s": [r["wall"] for r in runs],
                         "p50_s": median([percentile(r["latencies"], 50) for r in runs]),
                         "p99_s": median([percentile(r["latencies"], 99) for r in runs])}
            r = rows[arm]
            print(f"| {model} | {arm} | {r['rps']:.3f} | {r['p50_s']:.2f} | {r['p99_s']:.2f} |")
        figures[model] = {"arms": rows, "ratios": {
            "mixed / equal-sets": rows["mixed"]["rps"] / rows["equal-sets"]["rps"],
            "mixed / diffusers": rows["mixed"]["rps"] / rows["diffusers"]["rps"],
            "mixed / no-adapter": rows["mixed"]["rps"] / rows["no-adapter"]["rps"],
        }}
    print("\n| model | mixed / equal-sets (goal >= 1.5) | mixed / diffusers (goal >= 2) "
          "| mixed / no-adapter (goal >= 0.85 on flux-width) |")
    print("|---|---:|---:|---:|")
    for model, f in figures.items():
        r = f["ratios"]
        print(f"| {model} | {r['mixed / equal-sets']:.2f} | {r['mixed / diffusers']:.2f} "
              f"| {r['mixed / no-adapter']:.2f} |")
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", metavar="SPEC", help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch-threads", type=int, default=0, metavar="N",
                    help="torch threads of every arm (the engine's torch_threads; default: "
                         "the engine's choice, torch's default for diffusers); 1 keeps a "
                         "shared machine's busy cores from stalling a worker's threads")
    ap.add_argument("--json", help="also write the table's figures here")
    ap.add_argument("--child-timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    if args.arm:
        print(json.dumps(child(json.loads(args.arm))))
        return 0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="diffrt-bench-lora-") as work:
        prepared = prepare(tuple(args.models), Path(work))
        figures = report(run(args, prepared), args)
    print(f"\n(whole run {time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
