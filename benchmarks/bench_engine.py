"""Engine throughput and latency in both modes, against the pipeline called directly.

One run, printed (nothing asserted): N requests (distinct seeds) at a fixed
concurrency through ``step_streaming`` for STEP_BATCH and REQUEST_BATCH with
max_num_seqs 1 and B; then the same requests through ``pipeline.forward`` in a
plain loop in this process (batch 1, and batches of B: the best batching can
give), so the note can state the engine's overhead and the share of the
possible batching gain each mode achieves. All configurations stay alive and
their timed passes interleave, so load from other processes on a shared
machine hits them alike; the engine overhead is also measured inside one
traced run (wall time per request vs the worker's forward spans).

    .venv/bin/python benchmarks/bench_engine.py
    .venv/bin/python benchmarks/bench_engine.py --executor inproc --requests 16
"""

from __future__ import annotations

import argparse
import statistics
import time

from diffrt.cli.bench_load import EngineTarget, drive
from diffrt.cli.bench_stats import median, percentile
from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams


def make_requests(args: argparse.Namespace, tag: str) -> list[DiffusionRequest]:
    return [
        DiffusionRequest(
            prompt=f"prompt {i}", request_id=f"{tag}-{i}",
            sampling_params=SamplingParams(height=args.size, width=args.size,
                                           num_inference_steps=args.steps, seed=i))
        for i in range(args.requests)
    ]


def run_closed_loop(engine: DiffusionEngine, requests: list[DiffusionRequest],
                    concurrency: int) -> tuple[float, list[float]]:
    """``diffrt bench``'s closed loop (at most ``concurrency`` requests in flight).
    Returns (wall seconds, per-request latencies); a failed request raises."""
    samples, wall = drive(EngineTarget(engine), requests, concurrency=concurrency, rate=None)
    for request, sample in zip(requests, samples, strict=True):
        if not sample.ok:
            raise RuntimeError(f"{request.request_id}: {sample.error}")
    return wall, [s.latency for s in samples]


class EngineSubject:
    """One engine configuration, kept alive so passes of all subjects interleave."""

    def __init__(self, args: argparse.Namespace, step: bool, max_num_seqs: int,
                 wait_ms: float = 0.0):
        self.args = args
        self.max_num_seqs = max_num_seqs
        self.label = ("STEP_BATCH" if step else "REQUEST_BATCH") + (
            f" wait {wait_ms:g}ms" if wait_ms else "")
        wait = {"step_batch_max_wait_ms" if step else "request_batch_max_wait_ms": wait_ms}
        self.engine = DiffusionEngine.make_engine(EngineConfig(
            model=args.model, step_execution=step, max_num_seqs=max_num_seqs,
            executor_backend=args.executor, torch_threads=args.threads or None, **wait))

    def run(self, tag: str) -> tuple[float, list[float]]:
        return run_closed_loop(self.engine, make_requests(self.args, tag), self.args.concurrency)

    def close(self) -> None:
        self.engine.close()


class DirectSubject:
    """pipeline.forward + to_transfer + post_process in a plain loop, in this process."""

    def __init__(self, args: argparse.Namespace, batch: int, pipe):
        self.args, self.max_num_seqs, self.pipe = args, batch, pipe
        self.label = "direct loop"

    def run(self, tag: str) -> tuple[float, list[float]]:
        from diffrt.engine.pipelines import DiffusionRequestBatch

        # the image conversion every toy model's spec names; imported by this name so
        # compare_trees.py can drive older trees with this script too
        from diffrt.engine.postprocess import postprocess_output as postprocess

        requests = make_requests(self.args, tag)
        start = time.perf_counter()
        for i in range(0, len(requests), self.max_num_seqs):
            group = DiffusionRequestBatch(requests[i:i + self.max_num_seqs])
            for out in self.pipe.forward(group):
                host = self.pipe.to_transfer(out, group.sampling_params).cpu()
                postprocess(host, "pil")
        return time.perf_counter() - start, []

    def close(self) -> None:
        pass


def measure(subjects: list, args: argparse.Namespace) -> list[dict]:
    """A warm pass each (every batch shape of the workload), then ``repeats`` rounds
    that run every subject once in turn; each subject's fastest pass is reported,
    so load from other processes hits all subjects alike."""
    for subject in subjects:
        subject.run("warm")
    runs: dict[int, list] = {id(s): [] for s in subjects}
    for i in range(args.repeats):
        for subject in subjects:
            runs[id(subject)].append(subject.run(f"run{i}"))
    rows = []
    for subject in subjects:
        wall, lat = min(runs[id(subject)], key=lambda r: r[0])
        row = {"mode": subject.label, "max_num_seqs": subject.max_num_seqs,
               "rps": args.requests / wall}
        if lat:
            row.update(p50=median(lat), p99=percentile(lat, 99), mean=statistics.mean(lat))
        rows.append(row)
    return rows


def serve_passes(subjects: list, args: argparse.Namespace) -> None:
    """``--serve-passes``: after the warm pass, print one ``ready`` line (JSON: each
    subject's label and max_num_seqs), then run one timed pass of subject ``i``
    for each ``run i TAG`` line on stdin and answer ``wall SECONDS``. This is how
    ``compare_trees.py`` interleaves two trees pass by pass."""
    import json
    import sys

    for subject in subjects:
        subject.run("warm")
    print("ready " + json.dumps([[s.label, s.max_num_seqs] for s in subjects]), flush=True)
    for line in sys.stdin:
        verb, *rest = line.split()
        if verb != "run":
            break
        wall, _ = subjects[int(rest[0])].run(rest[1])
        print(f"wall {wall!r}", flush=True)


def worker_forward_share(args: argparse.Namespace) -> tuple[float, float]:
    """REQUEST_BATCH max_num_seqs=1 traced: (wall ms per request, worker forward ms
    per request). Both come from the same run, so machine noise cancels out."""
    import json
    import tempfile
    from pathlib import Path

    from diffrt import tracing

    with tempfile.TemporaryDirectory() as trace_dir:
        tracing.enable(trace_dir)
        try:
            config = EngineConfig(model=args.model, max_num_seqs=1, executor_backend=args.executor,
                                  torch_threads=args.threads or None)
            with DiffusionEngine.make_engine(config) as engine:
                run_closed_loop(engine, make_requests(args, "tw"), args.concurrency)
                start_us = tracing.now_us()
                wall, _ = run_closed_loop(engine, make_requests(args, "tr"), args.concurrency)
        finally:
            tracing.disable()
        forward_ms = 0.0
        for path in Path(trace_dir).glob("*.jsonl"):
            for line in path.read_text().splitlines():
                event = json.loads(line)
                if event.get("ph") == "X" and event["name"] == tracing.FORWARD_SPAN \
                        and event["ts"] >= start_us:
                    forward_ms += event["dur"] / 1000
    return wall / args.requests * 1000, forward_ms / args.requests


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
                        help="also run both modes at --batch with this coalescing window "
                             "(request/step_batch_max_wait_ms; 0: skip)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed passes per configuration; the fastest is reported")
    parser.add_argument("--serve-passes", action="store_true",
                        help="run passes on request from stdin (compare_trees.py's driver)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads in the workers and the direct loop (0: the "
                             "engine's auto choice, EngineConfig.torch_threads=None)")
    args = parser.parse_args()
    import torch

    from diffrt.engine.pipeline_runner import cpu_worker_threads
    from diffrt.platforms import current_platform

    direct_threads = args.threads or cpu_worker_threads(current_platform, 1)
    if direct_threads:
        torch.set_num_threads(direct_threads)  # the direct loop runs like one worker
    args.threads_label = direct_threads or "default"

    from diffrt.engine.pipelines import load_pipeline

    pipe = load_pipeline(args.model)
    subjects: list = [EngineSubject(args, step, n) for step in (True, False)
                      for n in (1, args.batch)]
    if args.batch_wait_ms:
        subjects += [EngineSubject(args, step, args.batch, args.batch_wait_ms)
                     for step in (True, False)]
    subjects += [DirectSubject(args, 1, pipe), DirectSubject(args, args.batch, pipe)]
    try:
        if args.serve_passes:
            serve_passes(subjects, args)
            return
        rows = measure(subjects, args)
    finally:
        for subject in subjects:
            subject.close()
    traced_wall, traced_forward = worker_forward_share(args)
    engine_rows = [r for r in rows if "p50" in r]
    direct1, direct_b = (r["rps"] for r in rows if "p50" not in r)

    print(f"\n{args.model} {args.size}x{args.size}, {args.steps} steps, {args.requests} requests "
          f"at concurrency {args.concurrency}, executor {args.executor}, "
          f"{args.threads_label} torch thread(s), best of {args.repeats} interleaved passes\n")
    print(f"{'mode':<26}{'max_num_seqs':>13}{'req/s':>9}{'p50 s':>9}{'p99 s':>9}")
    for r in engine_rows:
        print(f"{r['mode']:<26}{r['max_num_seqs']:>13}{r['rps']:>9.2f}{r['p50']:>9.3f}"
              f"{r['p99']:>9.3f}")
    print(f"{'direct loop':<26}{1:>13}{direct1:>9.2f}")
    print(f"{'direct loop':<26}{args.batch:>13}{direct_b:>9.2f}   (best possible batched)")

    by = {(r["mode"], r["max_num_seqs"]): r["rps"] for r in engine_rows}
    serial = by[("REQUEST_BATCH", 1)]
    print(f"\nengine overhead, REQUEST_BATCH max_num_seqs=1 vs direct batch-1 loop: "
          f"{(direct1 / serial - 1) * 100:+.1f}% time per request (goal within 5%)")
    print(f"same, measured inside one traced run: {traced_wall:.1f} ms per request of wall "
          f"time for {traced_forward:.1f} ms of worker forward -> "
          f"{(traced_wall / traced_forward - 1) * 100:+.1f}% engine overhead")
    step1 = by[("STEP_BATCH", 1)]
    print(f"STEP_BATCH max_num_seqs=1 vs the same loop: {(direct1 / step1 - 1) * 100:+.1f}% "
          "(one execute round trip per denoise step)")
    gain = direct_b - direct1
    for mode in [r["mode"] for r in engine_rows if r["max_num_seqs"] == args.batch]:
        achieved = by[(mode, args.batch)] - direct1
        share = achieved / gain * 100 if gain > 0 else float("nan")
        print(f"{mode} max_num_seqs={args.batch}: {by[(mode, args.batch)] / direct1:.2f}x the "
              f"direct batch-1 loop; possible {direct_b / direct1:.2f}x -> {share:.0f}% of the "
              "batching gain (goal >= 80%)")


if __name__ == "__main__":
    main()
