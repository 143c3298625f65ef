"""Priorities and deadlines under load (issue 33): ``bench_mixed_traffic.py --slo``.

tiny-flux, step mode (``max_num_seqs=16``, ``max_steps_per_tick=1`` for every
policy: an arrival waits for the tick in flight, and a 4-step tick of a full
batch is longer than an interactive deadline's slack; the multiprocess
executor). A mix
of 20 % *interactive* requests (priority 0, 64x64, 4 steps) and 80 % *batch*
requests (priority 1, sizes and steps of the mixed-traffic harness: {64x64,
128x128, 64x128, 128x64, 256x256} x {4, 8, 16}), seeded.

Every policy runs in a fresh process (the order rotating between rounds),
which first calibrates on a fifo engine of its own and then loads the
policy's engine from that calibration:

1. **solo**: every shape of the mix alone, 5 runs each, end to end; its
   median is the shape's *solo* time. Deadlines follow from it: interactive
   ``max(2 x solo, solo + 150 ms)``, batch ``10 x solo``.
2. **capacity**: the closed-loop throughput on the same mix (concurrency
   16; 8 for the video mix), requests/s: every request of the loop over its
   whole wall time, the drain at its end included, as the harness always
   counted it.
3. **load points**: Poisson arrivals at 80 % and 110 % of that capacity,
   ``--requests`` (300) a point. Every policy gets the same requests (shapes,
   prompts, seeds) and the same arrival draws, scaled to its own process's
   rates, and deadlines from its own process's solo times. Per point: each class's deadline attainment (finished
   within its deadline, out of the class), goodput (requests in time per
   second), p50/p99 latency per class, preemptions.

Why each process calibrates itself: this VM's speed drifts between runs and
between processes (fifo's capacity on the video mix came out 18.6-30.8
req/s in four quiet runs, calibrated once a run in a process of its own), and
a load point set from a calibration that caught the machine fast loads the
policy's process past what it sustains. Calibrated in the same process,
right before its load points, "80 %" means 80 % of what that process
sustains; the capacities of every process are printed, so their spread shows.

Nothing is asserted; the goals are printed with their figures: interactive
attainment >= 95 % at 80 % load and >= 90 % at 110 % (fifo's beside it),
goodput >= fifo's at both, batch p99 <= 1.5 x fifo's at 80 %.

``--slo-mix video`` (issue 50): images and video on one tiny-wan engine —
80 % *image* requests (one frame, 64x64, 4 steps, priority 0, deadline
3 x solo) and 20 % *video* clips (17 frames at 64x64, 4 or 8 steps,
priority 5, deadline 10 x solo); the same load points and policies. Goals:
image attainment >= 95 % at 80 % and >= 90 % at 110 %, video goodput
>= 0.9 x fifo's at both; the longest video latency over its solo time is
printed (the starvation bound is the aging rule's, tested in
``tests/engine/test_slo_engine.py``). ``--slo-aging-ticks N[,M...]`` runs
the ``slo`` policy once for each value of ``slo_aging_ticks`` (how many ticks
a request past its deadline waits per class it climbs), each a row of its
own (``slo@N``): variants side by side, on the same rounds.

    .venv/bin/python benchmarks/bench_mixed_traffic.py --slo           # 1 round
    .venv/bin/python benchmarks/bench_mixed_traffic.py --slo --quick   # 60 requests a point
    # the figures of docs/engine.md: 3 rounds, about 7 minutes here
    .venv/bin/python benchmarks/bench_mixed_traffic.py --slo --slo-mix video --slo-rounds 3
    # slo at two aging settings beside fifo and skip_ahead
    .venv/bin/python benchmarks/bench_mixed_traffic.py --slo --slo-mix video --slo-aging-ticks 16,1000
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from argparse import ArgumentTypeError
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
#: the video mix: (height, width, frames, steps) of its two classes
IMAGE = (64, 64, 1, 4)
CLIPS = ((64, 64, 17, 4), (64, 64, 17, 8))
VIDEO_SHARE = 0.2
VIDEO_SEQS = 4

#: per mix: the model, (urgent class, other class), each class's priority
MIXES: dict[str, dict[str, Any]] = {
    "images": {"model": "tiny-flux", "classes": ("interactive", "batch"),
               "priority": {"interactive": 0, "batch": 1}, "seqs": MAX_NUM_SEQS},
    "video": {"model": "tiny-wan", "classes": ("image", "video"),
              "priority": {"image": 0, "video": 5}, "seqs": VIDEO_SEQS},
}

#: one request's shape: (class, height, width, frames (0: the model's images), steps)
Shape = tuple[str, int, int, int, int]


def slo_traffic(n: int, seed: int, mix: str = "images") -> list[Shape]:
    """(class, height, width, frames, steps) of each request, seeded."""
    rng = random.Random(f"slo {seed}" if mix == "images" else f"slo {mix} {seed}")
    out: list[Shape] = []
    for _ in range(n):
        if mix == "video":
            out.append(("video", *rng.choice(CLIPS)) if rng.random() < VIDEO_SHARE
                       else ("image", *IMAGE))
        elif rng.random() < INTERACTIVE_SHARE:
            h, w, s = INTERACTIVE
            out.append(("interactive", h, w, 0, s))
        else:
            out.append(("batch", *rng.choice(SIZES), 0, rng.choice(STEPS)))
    return out


def deadline_of(kind: str, solo: float) -> float:
    if kind == "interactive":
        return max(2 * solo, solo + 0.15)
    if kind == "image":
        return 3 * solo
    return 10 * solo


def shape_key(height: int, width: int, frames: int, steps: int) -> str:
    return f"{height}x{width}x{steps}" if not frames else f"{frames}x{height}x{width}x{steps}"


# -- one engine in a fresh process ------------------------------------------------------------
def variants(aging: list[int] | None = None) -> tuple[str, ...]:
    """The policies a run compares: fifo, skip_ahead, and slo, once for each
    ``slo_aging_ticks`` of ``aging`` (``slo@N``; none: the engine's default)."""
    if not aging:
        return POLICIES
    return (*POLICIES[:-1], *(f"slo@{n}" for n in aging))


def _policy(variant: str) -> tuple[str, int | None]:
    """``slo@16`` -> ("slo", 16); ``fifo`` -> ("fifo", None)."""
    name, _, aging = variant.partition("@")
    return name, int(aging) if aging else None


def _engine(mix: str, variant: str, threads: int) -> Any:
    from diffrt.engine import DiffusionEngine, EngineConfig

    policy, aging = _policy(variant)
    extra: dict[str, Any] = {"torch_threads": threads} if threads else {}
    if aging is not None:
        extra["slo_aging_ticks"] = aging
    m = MIXES[mix]
    return DiffusionEngine.make_engine(EngineConfig(
        model=m["model"], step_execution=True, max_num_seqs=m["seqs"],
        max_steps_per_tick=STEPS_PER_TICK, scheduling_policy=policy, **extra))


def _request(i: int, tag: str, mix: str, kind: str, height: int, width: int, frames: int,
             steps: int, deadline: float | None = None) -> Any:
    from diffrt.engine import DiffusionRequest, SamplingParams

    video = {"num_frames": frames} if frames else {}
    return DiffusionRequest(prompt=f"a red fox {tag} {i}", sampling_params=SamplingParams(
        height=height, width=width, num_inference_steps=steps, seed=i,
        priority=MIXES[mix]["priority"][kind], deadline_s=deadline, **video))


def _calibrate(spec: dict[str, Any]) -> dict[str, Any]:
    """Solo medians per shape and the closed-loop capacity, on a fifo engine
    of this process."""
    from diffrt.cli.bench_load import EngineTarget, drive

    mix = spec["mix"]
    traffic = slo_traffic(spec["requests"], spec["seed"], mix)
    shapes = sorted({shape for shape in traffic})
    engine = _engine(mix, "fifo", spec["threads"])
    try:
        # every shape once first: a cold engine's first requests pay one-time
        # costs (allocations, the first prompt encodings) that no later one does
        warm = [_request(i, "cold", mix, *shape) for i, shape in enumerate(shapes)]
        drive(EngineTarget(engine), warm, concurrency=1, rate=None)
        solo = {}
        for kind, h, w, f, s in shapes:
            requests = [_request(i, "solo", mix, kind, h, w, f, s) for i in range(SOLO_RUNS)]
            samples, _ = drive(EngineTarget(engine), requests, concurrency=1, rate=None)
            solo[shape_key(h, w, f, s)] = median([x.latency for x in samples if x.ok])
        closed = slo_traffic(CAPACITY_REQUESTS, spec["seed"] + 1, mix)
        requests = [_request(i, "capacity", mix, *shape) for i, shape in enumerate(closed)]
        samples, wall = drive(EngineTarget(engine), requests,
                              concurrency=min(CONCURRENCY, 2 * MIXES[mix]["seqs"]), rate=None)
    finally:
        engine.close()
    return {"solo": solo, "capacity": sum(x.ok for x in samples) / wall}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One policy at every load of the spec (``--slo-child``), after this
    process's own calibration: per request, its class, latency, whether it finished within
    its deadline; the preemptions."""
    from diffrt.cli.bench_load import EngineTarget, drive

    mix = spec["mix"]
    traffic = slo_traffic(spec["requests"], spec["seed"], mix)
    cal = _calibrate(spec)
    deadlines = [deadline_of(kind, cal["solo"][shape_key(h, w, f, s)])
                 for kind, h, w, f, s in traffic]
    engine = _engine(mix, spec["policy"], spec["threads"])
    loads: dict[str, Any] = {}
    try:
        target = EngineTarget(engine)
        warm = [_request(i, "warm", mix, *shape) for i, shape in enumerate(sorted(set(traffic)))]
        drive(target, warm, concurrency=len(warm), rate=None)
        for load in LOADS:
            requests = [_request(i, f"load {load}", mix, *shape, deadlines[i])
                        for i, shape in enumerate(traffic)]
            before = engine.stats().preemptions_total
            samples, wall = drive(target, requests, concurrency=len(requests),
                                  rate=load * cal["capacity"], seed=spec["seed"])
            loads[str(load)] = {"kinds": [kind for kind, *_ in traffic],
                                "latency": [x.latency if x.ok else None for x in samples],
                                "in_time": [x.in_time for x in samples], "wall": wall,
                                "preemptions": engine.stats().preemptions_total - before}
    finally:
        engine.close()
    return {"calibration": cal, "loads": loads}


def _child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                        "bench_mixed_traffic.py"), "--slo-child", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['policy']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def aging_ticks(text: str) -> list[int]:
    """``16,1000`` -> [16, 1000] (an argparse type): each >= 1, as the
    engine's ``slo_aging_ticks``, repeats dropped."""
    values: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if not part.isdigit() or int(part) < 1:
            raise ArgumentTypeError(f"{part!r}: aging ticks are whole numbers >= 1")
        if int(part) not in values:
            values.append(int(part))
    if not values:
        raise ArgumentTypeError("give at least one number of ticks")
    return values


# -- the parent ------------------------------------------------------------------------------
def run_slo(args: Any) -> dict[str, Any]:
    requests = 60 if args.quick else args.slo_requests
    rounds = 1 if args.quick else args.slo_rounds
    mix_name = getattr(args, "slo_mix", "images")
    policies = variants(getattr(args, "slo_aging_ticks", None))
    base = {"requests": requests, "seed": args.seed, "threads": args.torch_threads,
            "mix": mix_name}
    points: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rnd in range(rounds):
        order = list(policies[rnd % len(policies):] + policies[:rnd % len(policies)])
        for policy in order:
            run = _child({**base, "policy": policy}, args.child_timeout)
            points[policy].append(run)
            cal = run["calibration"]
            print(f"  round {rnd + 1}/{rounds}: {policy} done (its capacity "
                  f"{cal['capacity']:.2f} req/s, solo (s) "
                  f"{json.dumps({k: round(v, 3) for k, v in cal['solo'].items()})})",
                  file=sys.stderr, flush=True)
    return report_slo(points, requests, mix_name)


def _figures(run: dict[str, Any], classes: tuple[str, str]) -> dict[str, Any]:
    """One policy at one load, one round: per class and overall."""
    out: dict[str, Any] = {}
    for kind in classes:
        idx = [i for i, k in enumerate(run["kinds"]) if k == kind]
        lat = [run["latency"][i] * 1000 for i in idx if run["latency"][i] is not None]
        out[kind] = {"attainment": sum(run["in_time"][i] for i in idx) / len(idx) if idx else None,
                     "goodput_rps": sum(run["in_time"][i] for i in idx) / run["wall"],
                     "p50_ms": median(lat), "p99_ms": percentile(lat, 99),
                     "max_ms": max(lat, default=None), "failed": len(idx) - len(lat)}
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


def report_slo(points: dict[str, list[dict[str, Any]]], requests: int,
               mix: str = "images") -> dict[str, Any]:
    policies = list(points)
    capacities = {policy: [run["calibration"]["capacity"] for run in runs]
                  for policy, runs in points.items()}
    every = [c for caps in capacities.values() for c in caps]
    urgent, other = classes = MIXES[mix]["classes"]
    loads = [str(load) for load in LOADS]
    table: dict[str, dict[str, dict[str, float | None]]] = {}
    for load in loads:
        table[load] = {}
        for policy in policies:
            per_round = [_figures(run["loads"][load], classes) for run in points[policy]]
            table[load][policy] = {
                **{f"{kind}_{name}": _median_of(per_round, (kind, name))
                   for kind in classes
                   for name in ("attainment", "goodput_rps", "p50_ms", "p99_ms", "max_ms")},
                "goodput_rps": _median_of(per_round, ("goodput_rps",)),
                "throughput_rps": _median_of(per_round, ("throughput_rps",)),
                "preemptions": _median_of(per_round, ("preemptions",)),
            }
    rounds = len(next(iter(points.values())))
    spread = (f"capacity, each process its own: {min(every):.2f}-{max(every):.2f} req/s "
              f"(median {median(every):.2f}; "
              + "; ".join(f"{p} {', '.join(f'{c:.2f}' for c in caps)}"
                          for p, caps in capacities.items()) + ")")
    if mix == "video":
        print(f"\nSLO mix on tiny-wan: {requests} requests a point, 80 % image (priority 0, "
              f"1 frame 64x64, 4 steps, deadline 3x solo), 20 % video (priority 5, 17 frames "
              f"64x64, 4 or 8 steps, deadline 10x solo); medians over {rounds} round(s);\n"
              f"{spread}\n")
    else:
        print(f"\nSLO mix on tiny-flux: {requests} requests a point, 20 % interactive "
              f"(priority 0, 64x64, 4 steps, deadline max(2x solo, solo + 150 ms)), 80 % batch "
              f"(priority 1, mixed sizes and steps, deadline 10x solo); medians over {rounds} "
              f"round(s);\n{spread}\n")
    head = (f"{'load':>5} {'policy':<11} {urgent + ' in time':>17} {other + ' in time':>14} "
            f"{'goodput/s':>9} {'x fifo':>7} {other + ' goodput':>13} {'x fifo':>7} "
            f"{urgent + ' p99 ms':>14} {other + ' p99 ms':>12} {'x fifo':>7} "
            f"{other + ' max ms':>12} {'preempt':>7}")
    print(head)
    for load in loads:
        fifo = table[load]["fifo"]
        for policy in policies:
            r = table[load][policy]
            print(f"{float(load):>5.0%} {policy:<11} {_pct(r[f'{urgent}_attainment']):>17} "
                  f"{_pct(r[f'{other}_attainment']):>14} {_num(r['goodput_rps']):>9} "
                  f"{_ratio(r['goodput_rps'], fifo['goodput_rps']):>7} "
                  f"{_num(r[f'{other}_goodput_rps']):>13} "
                  f"{_ratio(r[f'{other}_goodput_rps'], fifo[f'{other}_goodput_rps']):>7} "
                  f"{_num(r[f'{urgent}_p99_ms'], 0):>14} {_num(r[f'{other}_p99_ms'], 0):>12} "
                  f"{_ratio(r[f'{other}_p99_ms'], fifo[f'{other}_p99_ms']):>7} "
                  f"{_num(r[f'{other}_max_ms'], 0):>12} {_num(r['preemptions'], 0):>7}")
    goals: dict[str, bool] = {}
    for slo in (p for p in policies if p.startswith("slo")):
        goals.update(_goals(table, slo, mix))
    print("\ngoals:")
    for goal, met in goals.items():
        print(f"  {'met    ' if met else 'NOT MET'} {goal}")
    return {"mix": mix, "capacity_rps": capacities,
            "solo_s": {p: [run["calibration"]["solo"] for run in runs]
                       for p, runs in points.items()},
            "table": table, "goals": goals}


def _goals(table: dict[str, dict[str, dict[str, float | None]]], slo: str,
           mix: str) -> dict[str, bool]:
    """The issue's goals for one slo variant (its name leads each line)."""
    urgent = MIXES[mix]["classes"][0]
    low, high = (table[str(load)] for load in LOADS)
    goals = {
        f"{slo}: {urgent} attainment >= 95 % at 80 % load": _at_least(
            low[slo][f"{urgent}_attainment"], 0.95),
        f"{slo}: {urgent} attainment >= 90 % at 110 % load": _at_least(
            high[slo][f"{urgent}_attainment"], 0.90),
    }
    if mix == "video":
        for name, point in (("80 %", low), ("110 %", high)):
            goals[f"{slo}: video goodput >= 0.9x fifo's at {name}"] = _at_least(
                point[slo]["video_goodput_rps"], 0.9 * (point["fifo"]["video_goodput_rps"] or 0))
    else:
        goals.update({
            f"{slo}: goodput >= fifo's at 80 %": _at_least(low[slo]["goodput_rps"],
                                                          low["fifo"]["goodput_rps"]),
            f"{slo}: goodput >= fifo's at 110 %": _at_least(high[slo]["goodput_rps"],
                                                           high["fifo"]["goodput_rps"]),
            f"{slo}: batch p99 <= 1.5x fifo's at 80 %": _at_least(
                1.5 * (low["fifo"]["batch_p99_ms"] or 0), low[slo]["batch_p99_ms"]),
        })
    return goals


def _at_least(value: float | None, bound: float | None) -> bool:
    return value is not None and bound is not None and value >= bound


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ratio(x: float | None, base: float | None) -> str:
    return "-" if x is None or not base else f"{x / base:.2f}x"


__all__ = ["aging_ticks", "child", "run_slo", "slo_traffic"]
