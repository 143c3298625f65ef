"""Per-sample time of the reference pipelines at request batch 1/2/4/8.

What fused request batching can at best give an engine: each row runs one
`forward` over B compatible requests (different seeds) and reports the time
per sample and the speed-up over batch 1. "full" is forward + on-device
quantisation (output_type "pt"); "denoise" is output_type "latent" (no VAE
decode), which shows how much of the gain comes from the transformer.

    .venv/bin/python benchmarks/bench_pipelines.py
    .venv/bin/python benchmarks/bench_pipelines.py --size 256 --steps 8 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from diffrt.engine.pipelines import DiffusionRequestBatch, load_pipeline
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import SamplingParams


def make_batch(batch: int, args: argparse.Namespace, output_type: str) -> DiffusionRequestBatch:
    """`batch` compatible requests with different seeds and prompts."""
    params = dict(
        height=args.size,
        width=args.size,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        output_type=output_type,
    )
    return DiffusionRequestBatch(
        [DiffusionRequest(f"prompt {i}", SamplingParams(seed=i, **params)) for i in range(batch)]
    )


def measure(pipe, args: argparse.Namespace, output_type: str) -> dict[int, float]:
    """Best seconds per sample for each batch size.

    Batch sizes are interleaved round-robin over the repeats so that load from
    other processes on a shared machine spreads over all of them, and the
    minimum is kept (the run least disturbed by that load).
    """

    def run(batch: int) -> float:
        b = make_batch(batch, args, output_type)
        start = time.perf_counter()
        for out in pipe.forward(b):
            pipe.to_transfer(out, b.sampling_params)
        return (time.perf_counter() - start) / batch

    for batch in args.batches:
        run(batch)  # warm-up
    best = dict.fromkeys(args.batches, float("inf"))
    for _ in range(args.repeats):
        for batch in args.batches:
            best[batch] = min(best[batch], run(batch))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny-flux", "tiny-sd3"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--guidance", type=float, default=1.0, help=">1 runs CFG (2x rows)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    print(
        f"# {args.size}x{args.size}, {args.steps} steps, guidance {args.guidance}, "
        f"{torch.get_num_threads()} threads, best of {args.repeats}"
    )
    header = f"{'model':<10} {'batch':>5} {'full ms/sample':>15} {'speed-up':>9} {'denoise ms/sample':>18} {'speed-up':>9}"
    print(header)
    print("-" * len(header))
    for model in args.models:
        pipe = load_pipeline(model)
        full = measure(pipe, args, "pt")
        latent = measure(pipe, args, "latent")
        first = args.batches[0]
        for batch in args.batches:
            print(
                f"{model:<10} {batch:>5} {full[batch] * 1e3:>15.1f} "
                f"{full[first] / full[batch]:>8.2f}x {latent[batch] * 1e3:>18.1f} "
                f"{latent[first] / latent[batch]:>8.2f}x"
            )


if __name__ == "__main__":
    main()
