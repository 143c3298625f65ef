"""A rollout's step on a CPU: every request's rows in one transformer call, or a call each.

One denoise step of ``bench_rollouts.py``'s load — ``--prompts`` requests
(16) of ``--outputs`` images each (8), half with adapter A and half with B
(rank 16), true CFG 3 (the rows double: 256 in all) — on ``diffrt-shapes``
at 64x64, float32, in this process, two ways, the order alternating over
``--rounds`` rounds:

- ``one call``: every request's rows in one call (``denoise_step`` over all
  the requests: what a shared step batch does);
- ``per request``: a call per request (16 rows each: what the engine runs
  when it does not share the step, and what diffusers' rollout runs).

Prints each arm's median step time and the ratio; nothing asserted. Run
from the repository root:

    .venv/bin/python benchmarks/bench_step_rows.py --rounds 6
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch

from diffrt.cli.bench_stats import median

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_rollouts  # noqa: E402  (its adapters and prompts: the same rollout)

ARMS = ("one call", "per request")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--outputs", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--torch-threads", type=int, default=0, metavar="N")
    args = ap.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    from diffrt.engine import DiffusionRequest, EngineConfig, SamplingParams
    from diffrt.engine.lora.adapter_file import read_adapter
    from diffrt.engine.pipelines.interface import StepRequestState
    from diffrt.engine.pipelines.load import load_pipeline

    spec = EngineConfig(model=bench_rollouts.MODEL).model_spec()
    pipe = load_pipeline(spec, device=torch.device("cpu"), dtype=torch.float32)
    linears = pipe.enable_loras(2)
    files = bench_rollouts.make_adapters(Path(tempfile.mkdtemp(prefix="bench-step-rows-")))
    for slot, name in enumerate(bench_rollouts.ADAPTERS):
        pipe.row_loras.install(slot, slot + 1, read_adapter(
            files[name], "FluxPipeline", linears, spec.lora_target_modules))
    load = bench_rollouts.groups(args.prompts, args.outputs)

    defaults = msgspec.structs.asdict(spec.defaults)

    def step(arm: str) -> float:
        states = [StepRequestState(request=DiffusionRequest(
            prompt, negative_prompt="", sampling_params=SamplingParams(
                num_outputs_per_prompt=len(seeds), seeds=seeds).with_defaults(defaults)))
            for prompt, _, seeds in load]
        pipe.prepare_encode_batch(states)
        for state, (_, adapter, _) in zip(states, load, strict=True):
            state.loras = ((0 if adapter == "A" else 1, 1.0),)
        start = time.perf_counter()
        if arm == "one call":
            pipe.denoise_step(states)
        else:
            for st in states:
                pipe.denoise_step([st])
        return time.perf_counter() - start

    for arm in ARMS:  # warm: kernels, allocator
        step(arm)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        for arm in ARMS[r % 2:] + ARMS[:r % 2]:
            times[arm].append(step(arm))
    rows = sum(len(s) for _, _, s in load) * 2
    print(f"one denoise step of {rows} rows ({args.prompts} x {args.outputs} x CFG) on "
          f"{bench_rollouts.MODEL}, {torch.get_num_threads()} torch thread(s), "
          f"{args.rounds} rounds (medians)")
    med = {arm: median(t) for arm, t in times.items()}
    for arm in ARMS:
        print(f"  {arm:12s} {med[arm] * 1e3:8.1f} ms")
    print(f"  one call / per request: {med['one call'] / med['per request']:.2f}x the time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
