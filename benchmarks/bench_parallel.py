"""Each parallel method against one rank: latency and pixels, side by side.

Every case runs the same request on an engine of one rank with two torch
threads and on an engine of two ranks with one thread each (the same two
cores), in interleaved rounds, one case at a time (on accelerators each
engine holds a copy of the model); it prints the median latencies, their ratio
and the largest pixel difference between the two engines' images, and for
scale one rank with one thread (what each of the two ranks has). On this
CPU the point is correctness and the cost of the exchanges, not speed: two
ranks on two cores cannot beat one rank that already uses both. On N
accelerators the same command measures the speed-up (``--threads 0`` leaves
torch's default; ``--size 1024`` and a real folder with ``--flux`` /
``--sd3``)::

    .venv/bin/python benchmarks/bench_parallel.py                   # CPU, tiny models
    python benchmarks/bench_parallel.py --flux /models/FLUX.1-dev --sd3 /models/sd3.5 \\
        --size 1024 --steps 28 --threads 0

Cases: CFG parallel (SD3 with CFG), the rows of a CFG-less batch over the CFG
pair, Ulysses and ring (Flux and SD3), CFG parallel with the banded VAE decode.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diffrt.cli.bench_stats import median
from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams

LOOPBACK = {"worker_env": {"GLOO_SOCKET_IFNAME": "lo"}}


@dataclass
class Case:
    label: str
    family: str  # "flux" | "sd3": which model
    parallel: dict[str, Any]
    cfg: bool = True
    requests: int = 1
    times: dict[str, list[float]] = field(
        default_factory=lambda: {"one": [], "two": [], "single": []})
    max_diff: int = 0


CASES = [
    Case("CFG parallel 2 (sd3, CFG)", "sd3", {"cfg_parallel_size": 2}),
    Case("CFG pair, CFG-less batch of 2 (sd3)", "sd3", {"cfg_parallel_size": 2}, cfg=False,
         requests=2),
    Case("Ulysses 2 (flux)", "flux", {"ulysses_degree": 2}, cfg=False),
    Case("ring 2 (flux)", "flux", {"ring_degree": 2}, cfg=False),
    Case("Ulysses 2 (sd3, CFG)", "sd3", {"ulysses_degree": 2}),
    Case("CFG 2 + VAE parallel (sd3, CFG)", "sd3", {"cfg_parallel_size": 2,
                                                    "vae_parallel": True}),
]


def batch(case: Case, args: argparse.Namespace, round_: int) -> list[DiffusionRequest]:
    scale = {"guidance_scale": 5.0 if case.cfg else 1.0}
    return [DiffusionRequest(
        prompt=f"a lighthouse at dusk {i}", negative_prompt="blurry" if case.cfg else None,
        request_id=f"{case.label}-{round_}-{i}",
        sampling_params=SamplingParams(height=args.size, width=args.size,
                                       num_inference_steps=args.steps, seed=i, **scale))
        for i in range(case.requests)]


def run(engine: DiffusionEngine, requests: list[DiffusionRequest]) -> tuple[float, list]:
    start = time.perf_counter()
    outs = engine.generate(requests, timeout=600)
    elapsed = time.perf_counter() - start
    for out in outs:
        if not out.ok:
            raise RuntimeError(out.error)
    return elapsed, [np.asarray(o.images[0]).astype(np.int16) for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flux", default="tiny-flux", help="Flux model (default: %(default)s)")
    ap.add_argument("--sd3", default="tiny-sd3", help="SD3 model (default: %(default)s)")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads of the one-rank engine; each of the two ranks gets "
                         "half (0: torch's default for both)")
    args = ap.parse_args()
    models = {"flux": args.flux, "sd3": args.sd3}
    one_threads = args.threads or None
    two_threads = max(1, args.threads // 2) if args.threads else None
    for case in CASES:  # one case's engines at a time: on GPUs each holds a model copy
        model = models[case.family]
        engines = {
            "one": EngineConfig(model=model, max_num_seqs=2, torch_threads=one_threads),
            "two": EngineConfig(model=model, max_num_seqs=2, torch_threads=two_threads,
                                **LOOPBACK, **case.parallel)}
        if args.threads:  # one rank with one rank's share of the threads, for scale
            engines["single"] = EngineConfig(model=model, max_num_seqs=2,
                                             torch_threads=two_threads)
        started: dict[str, DiffusionEngine] = {}
        try:
            for name, config in engines.items():
                started[name] = DiffusionEngine.make_engine(config)
            for round_ in range(args.rounds + 1):  # round 0 warms the engines up
                pixels = {}
                for name, engine in started.items():
                    elapsed, pixels[name] = run(engine, batch(case, args, round_))
                    if round_:
                        case.times[name].append(elapsed)
                case.max_diff = max([case.max_diff] + [
                    int(np.abs(a - b).max())
                    for a, b in zip(pixels["one"], pixels["two"], strict=True)])
        finally:
            for engine in started.values():
                engine.close()
    print(f"{args.size}x{args.size}, {args.steps} steps, median of {args.rounds} interleaved "
          f"rounds; one rank x {one_threads or 'default'} threads vs two ranks x "
          f"{two_threads or 'default'} threads each")
    print(f"{'case':40s} {'1 rank ms':>10s} {'2 ranks ms':>11s} {'2/1':>6s} "
          f"{'1 rank x half ms':>17s} {'2/half':>7s} {'max |d| /255':>13s}")
    worst = 0
    for case in CASES:
        one, two = median(case.times["one"]), median(case.times["two"])
        single = median(case.times["single"])
        worst = max(worst, case.max_diff)
        scale = (f"{single * 1e3:17.1f} {two / single:7.2f}" if single is not None
                 else f"{'-':>17s} {'-':>7s}")
        print(f"{case.label:40s} {one * 1e3:10.1f} {two * 1e3:11.1f} {two / one:6.2f} "
              f"{scale} {case.max_diff:13d}")
    return 0 if worst <= 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
