"""Soak: thousands of requests, hundreds of silent consumers; memory stays bounded.

2,000 requests with distinct prompts go through one engine (step mode,
worker processes); 300 of them belong to consumers that read their first
progress output and then never read again, without closing their stream.
Their finished outputs wait in the shared-memory arena
(``max_pending_output_bytes``, 2 MiB by default: fewer 64x64 outputs than there
are silent consumers) until ``unread_output_timeout_s`` frees them; meanwhile a
full arena throttles the worker and admission waits. Every reading consumer must
complete with its image, and the resident memory of the engine process and
its workers must stay within the stated bound over the warm baseline:
twice the arena (it is mapped, and its touched pages counted, in the engine
and in the output rank) plus a fixed allowance for allocator and queue noise.
Printed, never asserted.

    .venv/bin/python benchmarks/soak_isolation.py
    .venv/bin/python benchmarks/soak_isolation.py --requests 400 --silent 60 --unread-timeout 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import threading
import time

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams

ALLOWANCE_MIB = 64.0


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except FileNotFoundError:
            pass
    return total / 1024


class Sampler(threading.Thread):
    """Peak resident memory of the processes together, and of each."""

    def __init__(self, pids: list[int], period_s: float = 0.1):
        super().__init__(daemon=True)
        self.pids, self.period_s, self.peak = pids, period_s, 0.0
        self.peaks = {pid: 0.0 for pid in pids}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.period_s):
            self.peak = max(self.peak, rss_mib(self.pids))
            for pid in self.pids:
                self.peaks[pid] = max(self.peaks[pid], rss_mib([pid]))


def make_request(i: int, args: argparse.Namespace) -> DiffusionRequest:
    return DiffusionRequest(
        prompt=f"soak prompt {i}: a {random.Random(i).choice(['red', 'blue', 'green'])} shape",
        request_id=f"soak-{i}",
        sampling_params=SamplingParams(height=args.size, width=args.size,
                                       num_inference_steps=args.steps, seed=i))


async def soak(engine: DiffusionEngine, args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    silent_ids = set(rng.sample(range(args.requests), args.silent))
    gate = asyncio.Semaphore(args.concurrency)
    held: list = []  # silent consumers' open streams, never read again until the end
    done = {"ok": 0, "failed": 0}

    async def reading(i: int) -> None:
        async with gate:
            out = await engine.generate_async(make_request(i, args))
        done["ok" if out.ok and out.images else "failed"] += 1

    async def silent(i: int) -> None:
        async with gate:
            agen = engine.step_streaming(make_request(i, args))
            await agen.__anext__()  # its first progress output, then silence
        held.append(agen)

    await asyncio.gather(*(silent(i) if i in silent_ids else reading(i)
                           for i in range(args.requests)))
    late = {"expired": 0, "image": 0, "other": 0}
    for agen in held:  # the silent consumers finally read: expired, or still there
        outs = [o async for o in agen]
        final = outs[-1] if outs else None
        key = ("image" if final is not None and final.ok else
               "expired" if final is not None and "output expired" in (final.error or "")
               else "other")
        late[key] += 1
    return {**done, **{f"silent_{k}": v for k, v in late.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-flux")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--silent", type=int, default=300)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--arena-mib", type=float, default=2.0,
                        help="max_pending_output_bytes, in MiB")
    parser.add_argument("--unread-timeout", type=float, default=30.0,
                        help="unread_output_timeout_s")
    args = parser.parse_args()
    arena = int(args.arena_mib * (1 << 20))
    config = EngineConfig(model=args.model, step_execution=True, max_num_seqs=args.max_num_seqs,
                          max_pending_output_bytes=arena,
                          unread_output_timeout_s=args.unread_timeout)
    with DiffusionEngine.make_engine(config) as engine:
        pids = [os.getpid(), *getattr(engine.executor, "worker_pids", [])]
        warm = [make_request(-1 - i, args) for i in range(4 * args.max_num_seqs)]
        engine.generate(warm)
        baseline = rss_mib(pids)
        baselines = {pid: rss_mib([pid]) for pid in pids}
        sampler = Sampler(pids)
        sampler.start()
        start = time.perf_counter()
        counts = asyncio.run(soak(engine, args))
        wall = time.perf_counter() - start
        sampler.stop.set()
        sampler.join()
        healthy = engine.is_healthy()
    growth = sampler.peak - baseline
    bound = 2 * args.arena_mib + ALLOWANCE_MIB
    reading = args.requests - args.silent
    print(f"\n{args.requests} requests ({args.silent} silent consumers), {args.model} "
          f"{args.size}x{args.size} {args.steps} steps, step mode max_num_seqs "
          f"{args.max_num_seqs}, arena {args.arena_mib:g} MiB, unread_output_timeout_s "
          f"{args.unread_timeout:g}: {wall:.1f} s\n")
    print(f"reading consumers completed  {counts['ok']} / {reading} "
          f"(failed {counts['failed']})")
    print(f"silent consumers, when read  expired {counts['silent_expired']}, image "
          f"{counts['silent_image']}, other {counts['silent_other']}")
    print(f"engine + worker RSS          baseline {baseline:.1f} MiB, peak {sampler.peak:.1f} "
          f"MiB, growth {growth:+.1f} MiB")
    for pid, name in zip(pids, ["engine", *[f"worker {i}" for i in range(len(pids) - 1)]],
                         strict=True):
        print(f"  {name:<27}baseline {baselines[pid]:.1f} MiB, peak growth "
              f"{sampler.peaks[pid] - baselines[pid]:+.1f} MiB")
    print(f"stated bound                 2 x arena + {ALLOWANCE_MIB:g} MiB = {bound:.1f} MiB "
          f"-> {'within' if growth <= bound else 'ABOVE'} ({growth / bound:.0%} of it)")
    print(f"engine healthy at the end    {healthy}")


if __name__ == "__main__":
    main()
