"""The derived token budget over fresh starts (issue 50): is it the same at every start?

``max_num_batched_tokens=None`` derives the step's token budget from the
step-cost model at warm-up (``engine/token_budget.py``). Before the idle
model was persisted, the budget followed one calibration's noise (1,503 to
280,443 tokens between runs here). This starts N fresh processes, one after
another, each building a tiny-flux step-mode engine (``max_num_seqs=4``) and
printing its budget, the idle model's reference step and its estimate of a
2048x2048, 1000-step request (what ``max_request_seconds`` is judged by):

- ``persisted``: every start shares one step-cost directory (a restart reads
  the model an earlier start saved; what a server's restarts do);
- ``fresh``: each start its own empty directory (nothing persisted).

The two modes alternate, start by start. Nothing is asserted::

    .venv/bin/python benchmarks/bench_token_budget.py            # 5 starts each
    .venv/bin/python benchmarks/bench_token_budget.py --starts 3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from statistics import median
from typing import Any

MODES = ("persisted", "fresh")


def child() -> dict[str, Any]:
    """One start: the budget, the idle reference and the large request's estimate."""
    from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams

    start = time.perf_counter()
    engine = DiffusionEngine.make_engine(EngineConfig(
        model="tiny-flux", step_execution=True, max_num_seqs=4))
    try:
        started = time.perf_counter() - start
        run_time = engine.run_time
        large = DiffusionRequest(prompt="a fox", sampling_params=SamplingParams(
            height=2048, width=2048, num_inference_steps=1000))
        return {"budget": engine.scheduler.token_budget, "start_s": started,
                "restored": bool(run_time.restored),
                "reference_s": run_time.reference(idle=True),
                "estimate_2048_1000_s": run_time.estimate(engine.spec.with_defaults(large),
                                                          idle=True)}
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--starts", type=int, default=5)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child()))
        return 0
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="diffrt-bench-budget-") as work:
        shared = os.path.join(work, "persisted")
        for i in range(args.starts):
            for mode in MODES:
                folder = shared if mode == "persisted" else os.path.join(work, f"fresh-{i}")
                env = {**os.environ, "DIFFRT_STEP_COST_DIR": folder}
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"],
                                      capture_output=True, text=True, env=env, timeout=600)
                if proc.returncode != 0:
                    raise RuntimeError(f"start {i} ({mode}) failed:\n{proc.stderr[-3000:]}")
                results[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(f"  start {i + 1}/{args.starts} {mode}: {results[mode][-1]}",
                      file=sys.stderr, flush=True)
    print(f"tiny-flux, step mode, max_num_seqs=4; {args.starts} fresh processes per mode, "
          "alternating")
    print(f"{'mode':<11}{'token budget at each start':>44}{'reference step s':>26}"
          f"{'2048² x 1000 estimate s':>32}")
    for mode in MODES:
        runs = results[mode]
        budgets = ", ".join(str(r["budget"] or "none") for r in runs)
        refs = [r["reference_s"] for r in runs if r["reference_s"] is not None]
        ests = [r["estimate_2048_1000_s"] for r in runs if r["estimate_2048_1000_s"] is not None]
        print(f"{mode:<11}{budgets:>44}"
              f"{f'{min(refs):.4f}-{max(refs):.4f}' if refs else '-':>26}"
              f"  {f'{min(ests):,.0f}-{max(ests):,.0f} (median {median(ests):,.0f})' if ests else '-':>30}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
