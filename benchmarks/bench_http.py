"""HTTP serving vs the in-process engine: the same load, the same engine
settings, measured side by side in one run.

A `diffrt serve` process and an in-process engine (worker processes both) are
started with the same settings; rounds alternate between driving the engine
directly (`diffrt bench`'s EngineTarget) and the server over HTTP
(`diffrt bench --base-url`'s HttpTarget, non-streamed b64 PNGs), and the
medians over the rounds are compared. The HTTP path adds what a deployment
adds: the request body, PNG encoding, base64, JSON and the socket.

    .venv/bin/python benchmarks/bench_http.py                   # 128x128, c=8, 5 rounds
    .venv/bin/python benchmarks/bench_http.py --rounds 7 --requests 48
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from diffrt.cli.bench_load import EngineTarget, drive
from diffrt.cli.bench_stats import summarize
from diffrt.cli.http_target import HttpTarget
from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def requests(args: argparse.Namespace, tag: str) -> list[DiffusionRequest]:
    return [DiffusionRequest(f"{tag} prompt {i}", SamplingParams(
        height=args.size, width=args.size, num_inference_steps=args.steps, seed=i))
        for i in range(args.requests)]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    script = Path(sys.executable).parent / "diffrt"
    proc = subprocess.Popen(
        [str(script), "serve", "--host", "127.0.0.1", "--port", str(port), "--step-execution",
         "--max-num-seqs", str(args.max_num_seqs), "--max-pending", "1000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"diffrt serve exited with {proc.returncode}")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("diffrt serve did not become ready")


def measure(target, args: argparse.Namespace, tag: str) -> dict:
    samples, wall = drive(target, requests(args, tag), concurrency=args.concurrency, rate=None)
    stats = summarize(samples, wall)
    if stats["failed"]:
        raise SystemExit(f"{tag}: {stats['failed']} request(s) failed: "
                         f"{[s.error for s in samples if not s.ok][:3]}")
    return stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32, help="per round and path")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    server, url = start_server(args)
    engine = None
    rows: dict[str, list[dict]] = {"in-process": [], "http": []}
    try:
        engine = DiffusionEngine.make_engine(EngineConfig(
            model="tiny-flux", step_execution=True, max_num_seqs=args.max_num_seqs))
        measure(EngineTarget(engine), args, "warm-up")
        measure(HttpTarget(url), args, "warm-up")
        for r in range(args.rounds):
            order = [("in-process", lambda: EngineTarget(engine)), ("http", lambda: HttpTarget(url))]
            if r % 2:
                order.reverse()  # neither path always runs first
            for name, target in order:
                rows[name].append(measure(target(), args, f"{name} round {r}"))
    finally:
        if engine is not None:
            engine.close()
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()

    def med(name: str, key: str) -> float:
        return statistics.median(s[key] for s in rows[name])

    print(f"tiny-flux {args.size}x{args.size}, {args.steps} steps, step mode, max_num_seqs "
          f"{args.max_num_seqs}, {args.requests} requests at concurrency {args.concurrency}, "
          f"{args.rounds} interleaved rounds (medians)")
    print(f"{'path':12s} {'req/s':>7s} {'p50 ms':>8s} {'p90 ms':>8s}  per-round req/s")
    for name in rows:
        per_round = " ".join(f"{s['throughput_rps']:.1f}" for s in rows[name])
        print(f"{name:12s} {med(name, 'throughput_rps'):7.2f} {med(name, 'latency_p50_ms'):8.0f} "
              f"{med(name, 'latency_p90_ms'):8.0f}  {per_round}")
    ratio = med("http", "throughput_rps") / med("in-process", "throughput_rps")
    p50 = med("http", "latency_p50_ms") / med("in-process", "latency_p50_ms")
    print(f"HTTP / in-process throughput: {ratio:.3f} (goal >= 0.95); p50 latency x{p50:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
