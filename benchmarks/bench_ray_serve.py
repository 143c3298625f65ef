"""One replica against two behind one Ray Serve endpoint, side by side.

Starts a local Ray instance on loopback and deploys the images API twice:
``/one`` with one replica (its engine with ``--threads`` torch threads) and
``/two`` with two replicas (half the threads each: the same cores). A closed
loop of ``--concurrency`` clients sends ``--requests`` requests to each, in
interleaved rounds; it prints throughput and latency medians and the ratio.
Then it kills one of ``/two``'s replicas and times how long Ray Serve takes
to have two running again.

    .venv/bin/python benchmarks/bench_ray_serve.py
    python benchmarks/bench_ray_serve.py --ray-address auto --model /models/FLUX.1-schnell \\
        --size 1024 --steps 4 --threads 0          # on a cluster: one replica per GPU
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import signal
import socket
import time

import httpx

from diffrt.cli.bench_stats import median, percentile
from diffrt.engine import EngineConfig
from diffrt.serve import ServeSettings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load(url: str, args: argparse.Namespace, round_: int) -> tuple[float, list[float]]:
    """(wall seconds, per-request latencies) of one closed-loop round."""
    def one(i: int) -> float:
        start = time.perf_counter()
        r = httpx.post(f"{url}/v1/images/generations", timeout=600, json={
            "prompt": f"a lighthouse {round_}-{i}", "size": f"{args.size}x{args.size}",
            "num_inference_steps": args.steps, "seed": i})
        r.raise_for_status()
        return time.perf_counter() - start

    start = time.perf_counter()
    with cf.ThreadPoolExecutor(args.concurrency) as pool:
        latencies = list(pool.map(one, range(args.requests)))
    return time.perf_counter() - start, latencies


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-flux")
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads of the one replica's engine; each of two gets half "
                         "(0: the engine's default)")
    ap.add_argument("--replica-cpus", type=float, default=0.25)
    ap.add_argument("--ray-address", default=None)
    args = ap.parse_args()

    import ray
    from ray import serve

    from diffrt.serve.ray_app import ReplicaSettings, StatsBoard, build_application

    if args.ray_address:
        ray.init(address=args.ray_address, log_to_driver=False)
    else:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo"}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    board = ray.remote(StatsBoard).options(num_cpus=0).remote()
    settings = ServeSettings(max_pending=4 * args.requests)
    threads = {"one": args.threads or None,
               "two": max(1, args.threads // 2) if args.threads else None}
    try:
        for name, count in (("one", 1), ("two", 2)):
            config = EngineConfig(model=args.model, step_execution=True, max_num_seqs=4,
                                  torch_threads=threads[name])
            serve.run(build_application(config, settings, ReplicaSettings(
                replicas=count, replica_cpus=args.replica_cpus), board),
                name=f"bench-{name}", route_prefix=f"/{name}")
        base = f"http://127.0.0.1:{port}"
        results: dict[str, list[tuple[float, list[float]]]] = {"one": [], "two": []}
        for round_ in range(args.rounds + 1):  # round 0 warms up
            for name in results:
                wall, latencies = load(f"{base}/{name}", args, round_)
                if round_:
                    results[name].append((wall, latencies))
        print(f"{args.model}, {args.size}x{args.size}, {args.steps} steps, {args.requests} "
              f"requests x {args.rounds} rounds, {args.concurrency} concurrent; one replica x "
              f"{threads['one'] or 'default'} threads vs two x {threads['two'] or 'default'}")
        print(f"{'replicas':10s} {'images/s':>9s} {'p50 s':>7s} {'p99 s':>7s}")
        rates = {}
        for name, rounds in results.items():
            rates[name] = median([args.requests / wall for wall, _ in rounds])
            latencies = [x for _, lat in rounds for x in lat]
            print(f"{name:10s} {rates[name]:9.2f} {median(latencies):7.2f} "
                  f"{percentile(latencies, 99):7.2f}")
        print(f"throughput two/one: {rates['two'] / rates['one']:.2f}")

        handle = serve.get_deployment_handle("ModelReplica", app_name="bench-two")
        pids: set[int] = set()
        for _ in range(50):
            pids.add(handle.pid.remote().result(timeout_s=30))
            if len(pids) == 2:
                break
        start = time.perf_counter()
        os.kill(min(pids), signal.SIGKILL)

        def running() -> int:
            status = serve.status().applications["bench-two"].deployments["ModelReplica"]
            return status.replica_states.get("RUNNING", 0)

        while running() == 2 and time.perf_counter() - start < 30:
            time.sleep(0.1)  # Ray notices the death
        while running() < 2 and time.perf_counter() - start < 300:
            time.sleep(0.2)
        print(f"a killed replica replaced (two running again) after "
              f"{time.perf_counter() - start:.1f} s")
    finally:
        for name in ("bench-one", "bench-two"):
            if name in serve.status().applications:
                serve.delete(name)
        if not args.ray_address:
            serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
