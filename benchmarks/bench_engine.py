"""Engine throughput and latency in both modes, against the pipeline called directly.

One run, printed (nothing asserted): N requests (distinct seeds) at a fixed
concurrency through ``step_streaming`` for STEP_BATCH and REQUEST_BATCH with
max_num_seqs 1 and B; then the same requests through ``pipeline.forward`` in a
plain loop in this process (batch 1, and batches of B: the best batching can
give), so the note can state the engine's overhead and the share of the
possible batching gain each mode achieves.

    .venv/bin/python benchmarks/bench_engine.py
    .venv/bin/python benchmarks/bench_engine.py --executor inproc --requests 16
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams


def make_requests(args: argparse.Namespace, tag: str) -> list[DiffusionRequest]:
    return [
        DiffusionRequest(
            prompt=f"prompt {i}", request_id=f"{tag}-{i}",
            sampling_params=SamplingParams(height=args.size, width=args.size,
                                           num_inference_steps=args.steps, seed=i))
        for i in range(args.requests)
    ]


async def drive(engine: DiffusionEngine, requests: list[DiffusionRequest],
                concurrency: int) -> tuple[float, list[float]]:
    """Closed loop: ``concurrency`` clients, each sends its next request when the
    previous one finished. Returns (wall seconds, per-request latencies)."""
    queue = list(reversed(requests))
    latencies: list[float] = []

    async def client() -> None:
        while queue:
            request = queue.pop()
            start = time.perf_counter()
            out = await engine.generate_async(request)
            if not out.ok:
                raise RuntimeError(f"{request.request_id}: {out.error}")
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - start, latencies


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def run_engine(args: argparse.Namespace, step: bool, max_num_seqs: int,
               wait_ms: float = 0.0) -> dict:
    config = EngineConfig(model=args.model, step_execution=step, max_num_seqs=max_num_seqs,
                          executor_backend=args.executor, request_batch_max_wait_ms=wait_ms,
                          torch_threads=args.threads or None)
    with DiffusionEngine.make_engine(config) as engine:
        # One untimed pass warms every batch shape this workload produces.
        asyncio.run(drive(engine, make_requests(args, "warm"), args.concurrency))
        runs = [asyncio.run(drive(engine, make_requests(args, f"run{i}"), args.concurrency))
                for i in range(args.repeats)]
    wall, lat = min(runs, key=lambda r: r[0])  # the least disturbed pass
    mode = "STEP_BATCH" if step else "REQUEST_BATCH"
    if wait_ms:
        mode += f" wait {wait_ms:g}ms"
    return {"mode": mode, "max_num_seqs": max_num_seqs,
            "rps": args.requests / wall, "p50": pct(lat, 50), "p99": pct(lat, 99),
            "mean": statistics.mean(lat)}


def run_direct(args: argparse.Namespace, batch: int) -> float:
    """Requests per second of pipeline.forward + to_transfer + post_process in a loop."""
    from diffrt.engine.pipelines import DiffusionRequestBatch, load_pipeline

    pipe = load_pipeline(args.model)
    requests = make_requests(args, "direct")

    def once() -> None:
        for i in range(0, len(requests), batch):
            group = DiffusionRequestBatch(requests[i:i + batch])
            for out in pipe.forward(group):
                host = pipe.to_transfer(out, group.sampling_params).cpu()
                pipe.post_process(host, "pil")

    once()  # warm-up
    walls = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        once()
        walls.append(time.perf_counter() - start)
    return len(requests) / min(walls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-flux")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="the larger max_num_seqs")
    parser.add_argument("--executor", default="mp", choices=["mp", "inproc"])
    parser.add_argument("--batch-wait-ms", type=float, default=20.0,
                        help="also run REQUEST_BATCH at --batch with this coalescing window "
                             "(0: skip)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed passes per configuration; the fastest is reported")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads in the workers and the direct loop (0: the "
                             "engine's auto choice, EngineConfig.torch_threads=None)")
    args = parser.parse_args()
    import torch

    from diffrt.engine.worker_runner import cpu_worker_threads
    from diffrt.platforms import current_platform

    direct_threads = args.threads or cpu_worker_threads(current_platform, 1)
    if direct_threads:
        torch.set_num_threads(direct_threads)  # the direct loop runs like one worker
    args.threads_label = direct_threads or "default"

    rows = [run_engine(args, step, n) for step in (True, False) for n in (1, args.batch)]
    if args.batch_wait_ms:
        rows.append(run_engine(args, False, args.batch, args.batch_wait_ms))
    direct1 = run_direct(args, 1)
    direct_b = run_direct(args, args.batch)

    print(f"\n{args.model} {args.size}x{args.size}, {args.steps} steps, {args.requests} requests "
          f"at concurrency {args.concurrency}, executor {args.executor}, "
          f"{args.threads_label} torch thread(s), best of {args.repeats} passes\n")
    print(f"{'mode':<26}{'max_num_seqs':>13}{'req/s':>9}{'p50 s':>9}{'p99 s':>9}")
    for r in rows:
        print(f"{r['mode']:<26}{r['max_num_seqs']:>13}{r['rps']:>9.2f}{r['p50']:>9.3f}"
              f"{r['p99']:>9.3f}")
    print(f"{'direct loop':<26}{1:>13}{direct1:>9.2f}")
    print(f"{'direct loop':<26}{args.batch:>13}{direct_b:>9.2f}   (best possible batched)")

    by = {(r["mode"], r["max_num_seqs"]): r["rps"] for r in rows}
    serial = by[("REQUEST_BATCH", 1)]
    print(f"\nengine overhead, REQUEST_BATCH max_num_seqs=1 vs direct batch-1 loop: "
          f"{(direct1 / serial - 1) * 100:+.1f}% time per request (goal within 5%)")
    step1 = by[("STEP_BATCH", 1)]
    print(f"STEP_BATCH max_num_seqs=1 vs the same loop: {(direct1 / step1 - 1) * 100:+.1f}% "
          "(one execute round trip per denoise step)")
    gain = direct_b - direct1
    for mode in [r["mode"] for r in rows if r["max_num_seqs"] == args.batch]:
        achieved = by[(mode, args.batch)] - direct1
        share = achieved / gain * 100 if gain > 0 else float("nan")
        print(f"{mode} max_num_seqs={args.batch}: {by[(mode, args.batch)] / direct1:.2f}x the "
              f"direct batch-1 loop; possible {direct_b / direct1:.2f}x -> {share:.0f}% of the "
              "batching gain (goal >= 80%)")


if __name__ == "__main__":
    main()
