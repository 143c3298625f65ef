"""Where a rollout's time goes: seconds inside the transformer against wall time.

``bench_rollouts.py``'s load (``--prompts`` x 8 seeds, adapters A and B,
flow-sde, log-probs and trajectories, ``diffrt-shapes`` at its defaults) in
this process, one system per run: ``diffrt`` (step execution, the in-process
executor, so the transformer runs here) or ``diffusers`` (as Flow-GRPO's
trainer rolls out). ``FluxTransformer2DModel.forward`` is wrapped to sum the
seconds and rows of its calls. Prints one line; nothing asserted. Run from
the repository root, alternating the systems for a side-by-side figure:

    for s in diffrt diffusers diffrt diffusers; do
        .venv/bin/python benchmarks/rollout_time_share.py $s; done
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_rollouts  # noqa: E402  (the same load)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("system", choices=("diffrt", "diffusers"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args(argv)

    import diffusers
    import torch

    spent = {"s": 0.0, "calls": 0, "rows": 0}
    forward = diffusers.FluxTransformer2DModel.forward

    @functools.wraps(forward)
    def timed(self: Any, hidden_states: torch.Tensor, *a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return forward(self, hidden_states, *a, **k)
        finally:
            spent["s"] += time.perf_counter() - start
            spent["calls"] += 1
            spent["rows"] += hidden_states.shape[0]

    diffusers.FluxTransformer2DModel.forward = timed  # type: ignore[method-assign]
    adapters = bench_rollouts.make_adapters(Path(tempfile.mkdtemp(prefix="rollout-share-")))
    load = bench_rollouts.groups(args.prompts, 8)
    warm = [(p, a, s[:2]) for p, a, s in (load[0], load[-1])]
    if args.system == "diffusers":
        pipe = bench_rollouts.diffusers_pipeline(adapters)
        for prompt, adapter, seeds in warm:
            bench_rollouts.diffusers_rollout(pipe, prompt, adapter, seeds, 2)
        spent.update(s=0.0, calls=0, rows=0)
        start = time.perf_counter()
        for prompt, adapter, seeds in load:
            bench_rollouts.diffusers_rollout(pipe, prompt, adapter, seeds, args.steps)
        wall = time.perf_counter() - start
    else:
        from diffrt.engine import DiffusionEngine, EngineConfig

        with DiffusionEngine.make_engine(EngineConfig(
                model=bench_rollouts.MODEL, step_execution=True, max_num_seqs=len(load),
                dtype="float32", lora_modules=adapters, executor_backend="inproc")) as engine:
            bench_rollouts.check(engine.generate(bench_rollouts.diffrt_requests(
                warm, 2, deterministic=False)))
            spent.update(s=0.0, calls=0, rows=0)
            start = time.perf_counter()
            bench_rollouts.check(engine.generate(bench_rollouts.diffrt_requests(
                load, args.steps, deterministic=False)))
            wall = time.perf_counter() - start
    print(f"{args.system}: wall {wall:.2f} s, transformer {spent['s']:.2f} s "
          f"({spent['s'] / wall:.0%}), {spent['calls']} calls, {spent['rows']} rows, "
          f"{torch.get_num_threads()} torch threads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
