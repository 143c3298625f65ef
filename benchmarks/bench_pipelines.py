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


def time_batch(pipe, batch: int, args: argparse.Namespace, output_type: str) -> float:
    """Best seconds per sample over `args.repeats` forwards after one warm-up
    (the minimum is the least disturbed by other processes on a shared machine)."""

    def requests() -> DiffusionRequestBatch:
        params = dict(
            height=args.size,
            width=args.size,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance,
            output_type=output_type,
        )
        return DiffusionRequestBatch(
            [
                DiffusionRequest(f"prompt {i}", SamplingParams(seed=i, **params))
                for i in range(batch)
            ]
        )

    def run() -> None:
        b = requests()
        for out in pipe.forward(b):
            pipe.to_transfer(out, b.sampling_params)

    run()
    samples = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        run()
        samples.append((time.perf_counter() - start) / batch)
    return min(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny-flux", "tiny-sd3"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--guidance", type=float, default=1.0, help=">1 runs CFG (2x rows)")
    parser.add_argument("--repeats", type=int, default=7)
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
        base_full = base_latent = None
        for batch in args.batches:
            full = time_batch(pipe, batch, args, "pt")
            latent = time_batch(pipe, batch, args, "latent")
            base_full = base_full or full
            base_latent = base_latent or latent
            print(
                f"{model:<10} {batch:>5} {full * 1e3:>15.1f} {base_full / full:>8.2f}x "
                f"{latent * 1e3:>18.1f} {base_latent / latent:>8.2f}x"
            )


if __name__ == "__main__":
    main()
