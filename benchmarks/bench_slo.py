"""Priorities and deadlines under load (issue 33): ``bench_mixed_traffic.py --slo``.

tiny-flux, step mode (``max_num_seqs=16``, ``max_steps_per_tick=1`` for every
policy: an arrival waits for the tick in flight, and a 4-step tick of a full
batch is longer than an interactive deadline's slack; the multiprocess
executor). A mix
of 20 % *interactive* requests (priority 0, 64x64, 4 steps) and 80 % *batch*
requests (priority 1, sizes and steps of the mixed-traffic harness: {64x64,
128x128, 64x128, 128x64, 256x256} x {4, 8, 16}), seeded.

1. **solo**: every shape of the mix alone, 5 runs each, end to end on a fifo
   engine; its median is the shape's *solo* time. Deadlines follow from it:
   interactive ``max(2 x solo, solo + 150 ms)``, batch ``10 x solo``.
2. **capacity**: fifo's closed-loop throughput on the same mix (concurrency
   16), requests/s. Both are measured again in every round (a machine whose
   speed drifts between processes would otherwise load the points wrongly).
3. **load points**: Poisson arrivals at 80 % and 110 % of that capacity,
   ``--requests`` (300) a point, the same arrivals and requests for every
   policy (fifo, skip_ahead, slo), each policy in a fresh process and the
   order rotating between rounds. Per point: each class's deadline attainment
   (finished within its deadline, out of the class), goodput (requests in
   time per second), p50/p99 latency per class, preemptions.

Nothing is asserted; the goals are printed with their figures: interactive
attainment >= 95 % at 80 % load and >= 90 % at 110 % (fifo's beside it),
goodput >= fifo's at both, batch p99 <= 1.5 x fifo's at 80 %.

    .venv/bin/python benchmarks/bench_mixed_traffic.py --slo           # about 15 minutes
    .venv/bin/python benchmarks/bench_mixed_traffic.py --slo --quick   # 60 requests a point
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import defaultdict
from typing import Any

from diffrt.cli.bench_stats import median, percentile

SIZES = ((64, 64), (128, 128), (64, 128), (128, 64), (256, 256))
STEPS = (4, 8, 16)
INTERACTIVE = (64, 64, 4)
INTERACTIVE_SHARE = 0.2
POLICIES = ("fifo", "skip_ahead", "slo")
LOADS = (0.8, 1.1)
SOLO_RUNS = 5
CONCURRENCY = 16
MAX_NUM_SEQS = 16
CAPACITY_REQUESTS = 96
#: every policy's ``max_steps_per_tick``: an arrival waits for the tick in
#: flight, up to this many steps of the running batch, before any policy can
#: admit it (the engine's default 4 is a throughput setting)
STEPS_PER_TICK = 1


def slo_traffic(n: int, seed: int) -> list[tuple[str, int, int, int]]:
    """(class, height, width, steps) of each request, seeded."""
    rng = random.Random(f"slo {seed}")
    out = []
    for _ in range(n):
        if rng.random() < INTERACTIVE_SHARE:
            out.append(("interactive", *INTERACTIVE))
        else:
            out.append(("batch", *rng.choice(SIZES), rng.choice(STEPS)))
    return out


def deadline_of(kind: str, solo: float) -> float:
    return max(2 * solo, solo + 0.15) if kind == "interactive" else 10 * solo


def shape_key(height: int, width: int, steps: int) -> str:
    return f"{height}x{width}x{steps}"


# -- one engine in a fresh process ------------------------------------------------------------
def _engine(policy: str, threads: int) -> Any:
    from diffrt.engine import DiffusionEngine, EngineConfig

    extra = {"torch_threads": threads} if threads else {}
    return DiffusionEngine.make_engine(EngineConfig(
        model="tiny-flux", step_execution=True, max_num_seqs=MAX_NUM_SEQS,
        max_steps_per_tick=STEPS_PER_TICK, scheduling_policy=policy, **extra))


def _request(i: int, tag: str, kind: str, height: int, width: int, steps: int,
             deadline: float | None = None) -> Any:
    from diffrt.engine import DiffusionRequest, SamplingParams

    return DiffusionRequest(prompt=f"a red fox {tag} {i}", sampling_params=SamplingParams(
        height=height, width=width, num_inference_steps=steps, seed=i,
        priority=0 if kind == "interactive" else 1, deadline_s=deadline))


def _calibrate(spec: dict[str, Any]) -> dict[str, Any]:
    """Solo medians per shape and fifo's closed-loop capacity."""
    from diffrt.cli.bench_load import EngineTarget, drive

    mix = slo_traffic(spec["requests"], spec["seed"])
    shapes = sorted({(h, w, s) for _, h, w, s in mix})
    engine = _engine("fifo", spec["threads"])
    try:
        target = EngineTarget(engine)
        solo = {}
        for h, w, s in shapes:
            requests = [_request(i, "solo", "batch", h, w, s) for i in range(SOLO_RUNS)]
            samples, _ = drive(target, requests, concurrency=1, rate=None)
            solo[shape_key(h, w, s)] = median([x.latency for x in samples if x.ok])
        closed = slo_traffic(CAPACITY_REQUESTS, spec["seed"] + 1)
        requests = [_request(i, "capacity", *shape) for i, shape in enumerate(closed)]
        samples, wall = drive(target, requests, concurrency=CONCURRENCY, rate=None)
    finally:
        engine.close()
    return {"solo": solo, "capacity": sum(x.ok for x in samples) / wall}


def _point(spec: dict[str, Any]) -> dict[str, Any]:
    """One policy at every load of the spec: per request, its class, latency,
    whether it finished within its deadline; the preemptions."""
    from diffrt.cli.bench_load import EngineTarget, drive

    mix = slo_traffic(spec["requests"], spec["seed"])
    engine = _engine(spec["policy"], spec["threads"])
    out: dict[str, Any] = {}
    try:
        target = EngineTarget(engine)
        warm = [_request(i, "warm", "batch", h, w, 4) for i, (h, w) in enumerate(SIZES)]
        drive(target, warm, concurrency=len(warm), rate=None)
        for load, rate in spec["rates"].items():
            requests = [_request(i, f"load {load}", kind, h, w, s, spec["deadlines"][i])
                        for i, (kind, h, w, s) in enumerate(mix)]
            before = engine.stats().preemptions_total
            samples, wall = drive(target, requests, concurrency=len(requests), rate=rate,
                                  seed=spec["seed"])
            out[load] = {"kinds": [kind for kind, *_ in mix],
                         "latency": [x.latency if x.ok else None for x in samples],
                         "in_time": [x.in_time for x in samples], "wall": wall,
                         "preemptions": engine.stats().preemptions_total - before}
    finally:
        engine.close()
    return out


def child(spec: dict[str, Any]) -> dict[str, Any]:
    return _calibrate(spec) if spec["kind"] == "calibrate" else _point(spec)


def _child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                        "bench_mixed_traffic.py"), "--slo-child", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['kind']} {spec.get('policy', '')} failed:\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the parent ------------------------------------------------------------------------------
def run_slo(args: Any) -> dict[str, Any]:
    requests = 60 if args.quick else args.slo_requests
    rounds = 1 if args.quick else args.slo_rounds
    base = {"requests": requests, "seed": args.seed, "threads": args.torch_threads}
    mix = slo_traffic(requests, args.seed)
    points: dict[str, list[dict[str, Any]]] = defaultdict(list)
    calibrations = []
    rates: dict[str, float] = {}
    for rnd in range(rounds):
        # each round measures solo times and capacity afresh: a machine whose
        # speed drifts would otherwise load a later round's points wrongly
        cal = _child({**base, "kind": "calibrate"}, args.child_timeout)
        calibrations.append(cal)
        deadlines = [deadline_of(kind, cal["solo"][shape_key(h, w, s)]) for kind, h, w, s in mix]
        rates = {str(load): load * cal["capacity"] for load in LOADS}
        print(f"  round {rnd + 1}/{rounds}: solo (s) "
              f"{json.dumps({k: round(v, 3) for k, v in cal['solo'].items()})}", file=sys.stderr)
        print(f"  round {rnd + 1}/{rounds}: fifo capacity {cal['capacity']:.2f} req/s; rates "
              f"{ {k: round(v, 2) for k, v in rates.items()} }", file=sys.stderr, flush=True)
        order = list(POLICIES[rnd % len(POLICIES):] + POLICIES[:rnd % len(POLICIES)])
        for policy in order:
            points[policy].append(_child({**base, "kind": "point", "policy": policy,
                                          "rates": rates, "deadlines": deadlines},
                                         args.child_timeout))
            print(f"  round {rnd + 1}/{rounds}: {policy} done", file=sys.stderr, flush=True)
    return report_slo(calibrations, points, rates, requests)


def _figures(run: dict[str, Any]) -> dict[str, Any]:
    """One policy at one load, one round: per class and overall."""
    out: dict[str, Any] = {}
    for kind in ("interactive", "batch"):
        idx = [i for i, k in enumerate(run["kinds"]) if k == kind]
        lat = [run["latency"][i] * 1000 for i in idx if run["latency"][i] is not None]
        out[kind] = {"attainment": sum(run["in_time"][i] for i in idx) / len(idx) if idx else None,
                     "p50_ms": median(lat), "p99_ms": percentile(lat, 99),
                     "failed": len(idx) - len(lat)}
    out["goodput_rps"] = sum(run["in_time"]) / run["wall"]
    out["throughput_rps"] = sum(x is not None for x in run["latency"]) / run["wall"]
    out["preemptions"] = run["preemptions"]
    return out


def _median_of(rounds: list[dict[str, Any]], path: tuple[str, ...]) -> float | None:
    values = []
    for r in rounds:
        v: Any = r
        for key in path:
            v = v[key]
        if v is not None:
            values.append(v)
    return median(values)


def report_slo(calibrations: list[dict[str, Any]], points: dict[str, list[dict[str, Any]]],
               rates: dict[str, float], requests: int) -> dict[str, Any]:
    capacities = [cal["capacity"] for cal in calibrations]
    table: dict[str, dict[str, dict[str, float | None]]] = {}
    for load in rates:
        table[load] = {}
        for policy in POLICIES:
            per_round = [_figures(run[load]) for run in points[policy]]
            table[load][policy] = {
                "interactive_attainment": _median_of(per_round, ("interactive", "attainment")),
                "batch_attainment": _median_of(per_round, ("batch", "attainment")),
                "goodput_rps": _median_of(per_round, ("goodput_rps",)),
                "throughput_rps": _median_of(per_round, ("throughput_rps",)),
                "interactive_p50_ms": _median_of(per_round, ("interactive", "p50_ms")),
                "interactive_p99_ms": _median_of(per_round, ("interactive", "p99_ms")),
                "batch_p50_ms": _median_of(per_round, ("batch", "p50_ms")),
                "batch_p99_ms": _median_of(per_round, ("batch", "p99_ms")),
                "preemptions": _median_of(per_round, ("preemptions",)),
            }
    print(f"\nSLO mix on tiny-flux: {requests} requests a point, 20 % interactive "
          f"(priority 0, 64x64, 4 steps, deadline max(2x solo, solo + 150 ms)), 80 % batch "
          f"(priority 1, mixed sizes and steps, deadline 10x solo); fifo's closed-loop "
          f"capacity per round {', '.join(f'{c:.2f}' for c in capacities)} req/s; medians "
          f"over {len(calibrations)} round(s)\n")
    head = (f"{'load':>5} {'policy':<11} {'inter. in time':>14} {'batch in time':>13} "
            f"{'goodput/s':>9} {'x fifo':>7} {'inter. p99 ms':>13} {'batch p99 ms':>12} "
            f"{'x fifo':>7} {'preempt':>7}")
    print(head)
    for load in rates:
        fifo = table[load]["fifo"]
        for policy in POLICIES:
            r = table[load][policy]
            print(f"{float(load):>5.0%} {policy:<11} {_pct(r['interactive_attainment']):>14} "
                  f"{_pct(r['batch_attainment']):>13} {_num(r['goodput_rps']):>9} "
                  f"{_ratio(r['goodput_rps'], fifo['goodput_rps']):>7} "
                  f"{_num(r['interactive_p99_ms'], 0):>13} {_num(r['batch_p99_ms'], 0):>12} "
                  f"{_ratio(r['batch_p99_ms'], fifo['batch_p99_ms']):>7} "
                  f"{_num(r['preemptions'], 0):>7}")
    low, high = (table[str(load)] for load in LOADS)
    goals = {
        "interactive attainment >= 95 % at 80 % load": _at_least(
            low["slo"]["interactive_attainment"], 0.95),
        "interactive attainment >= 90 % at 110 % load": _at_least(
            high["slo"]["interactive_attainment"], 0.90),
        "goodput >= fifo's at 80 %": _at_least(low["slo"]["goodput_rps"],
                                               low["fifo"]["goodput_rps"]),
        "goodput >= fifo's at 110 %": _at_least(high["slo"]["goodput_rps"],
                                                high["fifo"]["goodput_rps"]),
        "batch p99 <= 1.5x fifo's at 80 %": _at_least(
            1.5 * (low["fifo"]["batch_p99_ms"] or 0), low["slo"]["batch_p99_ms"]),
    }
    print("\ngoals (slo):")
    for goal, met in goals.items():
        print(f"  {'met    ' if met else 'NOT MET'} {goal}")
    return {"solo_s": [cal["solo"] for cal in calibrations], "capacity_rps": capacities,
            "table": table, "goals": goals}


def _at_least(value: float | None, bound: float | None) -> bool:
    return value is not None and bound is not None and value >= bound


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ratio(x: float | None, base: float | None) -> str:
    return "-" if x is None or not base else f"{x / base:.2f}x"


__all__ = ["child", "run_slo", "slo_traffic"]
