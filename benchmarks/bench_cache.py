"""Step caches (issue 32): what they skip, what it costs in quality, what it saves,
and diffusers' own First-Block Cache on the same folders.

One run, in this process, on CPU: each measure side by side, timings in
interleaved rounds (the order rotates), medians printed with ratios; nothing
asserted. Sections:

1. **where the time goes** per model, uncached (``stage_timers.py``: the
   transformer, the VAE, the text encoders; and the share of the transformer
   spent in its blocks, the only part a step cache can skip): diffrt-shapes
   (64x64, 12 steps, true CFG 3: two rows a request), tiny-flux at 28 steps
   and tiny-sd3 at 28 steps (128x128, SD3 with CFG 7: two rows).
2. **TeaCache's polynomial, fitted**: its rescaling belongs to a checkpoint,
   and the tiny models have none. Over uncached runs (prompts and seeds apart
   from the evaluation's) forward hooks on ``transformer_blocks[0].norm1``
   and ``proj_out`` record, per step, the relative L1 change (the policies'
   own ``relative_l1``) of the first block's modulated input (x) and of the
   transformer's output (y, the prediction: TeaCache's calibration target);
   ``numpy.polyfit(x, y, 1)``: the TeaCache authors fit degree 4 over their
   checkpoints' range, but over a tiny model's narrow range a quartic fits
   no better and turns negative just beyond it, where requests of fewer
   steps land (its R^2 and its value there are printed beside); a fit with
   R^2 below ``MIN_FIT_R2`` (0.1) is not used (the distance as it is). Printed
   highest power first, ready for ``CacheSupport(teacache_rescale=...)``
   (the registry entries carry them); the TeaCache
   runs below use them. On Wan (``tiny-wan``, or any Wan folder registered:
   ``--fit-only MODEL``, this section alone) x is the change of the time
   embedding ``temb`` (each expert's ``condition_embedder``'s first output,
   the signal the TeaCache authors fit Wan 2.1 on and diffrt's Wan TeaCache
   reads) and y of ``proj_out``'s, over both of Wan 2.2's experts as each
   step runs one; the TeaCache
   runs below use them (the pipeline's ``spec`` replaced by one whose
   ``cache.teacache_rescale`` is the fit: ``msgspec.structs.replace``).
3. **quality and savings at three thresholds per policy** against uncached,
   each request alone in ``pipeline.forward`` (request mode; a cached request
   runs in steps): diffrt-shapes' classifier on the 30 held-out prompts
   (seeds 0..29, as ``scripts/train_demo_model.py`` evaluates), counts out of
   30 per attribute; tiny-flux and tiny-sd3: PSNR of the cached image against
   the uncached one of the same seed, and the transformer time ratio
   (cached / uncached, the stage timers' transformer seconds: every diffrt
   transformer call goes through ``FlowMatchPipeline.run_transformer``). The
   share reused: steps reused / steps, which is the share of the *skippable*
   block evaluations (First-Block Cache always runs block 0: N-1 skippable a
   step; TeaCache skips all N) and, for TeaCache, of all of them; the share
   of all N block evaluations is printed beside it. diffrt-shapes is also
   swept over finer thresholds to find the ones that meet its goal.
4. **step mode x8, half the requests cached**: a step engine (inproc,
   max_num_seqs=8) on tiny-flux at 28 steps, 8 requests at once of which 4
   ask for first-block at the default threshold: the wall time (and the
   transformer time) saved against all 8 uncached, over the sum of those 4
   requests' solo savings (each alone cached against alone uncached).
5. **the peer**: diffusers' ``transformer.enable_cache(FirstBlockCacheConfig
   (threshold))`` on the same folders (tiny-flux, diffrt-shapes), one prompt
   a call, over a grid of its thresholds; its skipped share (its head
   block's decisions, counted) against its quality, interpolated at diffrt's
   First-Block shares. diffusers decides per CFG branch (``cache_context``
   "cond" / "uncond": on diffrt-shapes each branch skips on its own), diffrt
   per request (both rows together).
6. **goals**, met or not, and the thresholds that meet them per model.

``--torch-threads`` (default 1: a shared machine's busy cores do not stall
the threads of a timed call) is torch's thread count for every measure. Run
from the repository root:

    .venv/bin/python benchmarks/bench_cache.py            # about 10 minutes on 2 cores
    .venv/bin/python benchmarks/bench_cache.py --quick    # about a minute (smoke run)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from diffrt.cli.bench_stats import median

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

FB, TC = "first-block", "teacache"
#: the degree of the fitted TeaCache polynomial (see section 2)
FIT_DEGREE = 1
#: a fit explaining less of the output's change than this is not used
MIN_FIT_R2 = 0.1
POLICY_NAMES = (FB, TC)
#: the models and the steps they run at (None: the model's own, 12)
MODELS = {"diffrt-shapes": 12, "tiny-flux": 28, "tiny-sd3": 28}
#: the steps of the models ``--fit-only`` fits (section 2 alone): those above and Wan's
FIT_STEPS = {**MODELS, "tiny-wan": 28}
#: the three thresholds of each policy's table, per model (the policy's default among them)
THRESHOLDS = {
    "diffrt-shapes": {FB: (0.1, 0.2, 0.3), TC: (0.1, 0.25, 0.5)},
    "tiny-flux": {FB: (0.05, 0.1, 0.2), TC: (0.1, 0.25, 0.5)},
    "tiny-sd3": {FB: (0.1, 0.2, 0.3), TC: (0.1, 0.25, 0.5)},
}
#: diffrt-shapes' finer sweep, for the thresholds that meet its goal
SWEEP = {FB: (0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5),
         TC: (0.1, 0.15, 0.2, 0.25, 0.35, 0.5, 0.75, 1.0)}
#: diffusers' First-Block Cache thresholds tried, per folder
PEER_THRESHOLDS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.8)
#: what diffusers is given to run what diffrt runs by default on the folder
#: (bench_vs_diffusers.py's MODELS): diffrt-shapes' true CFG 3 against "" and 16 T5 tokens
PEER_KWARGS: dict[str, dict[str, Any]] = {
    "tiny-flux": {"guidance_scale": 3.5},
    "diffrt-shapes": {"guidance_scale": 1.0, "true_cfg_scale": 3.0, "negative_prompt": "",
                      "max_sequence_length": 16},
}
TINY_PROMPTS = ("a red fox in the snow", "a lighthouse at dusk", "a bowl of ramen",
                "a city street in the rain", "a mountain lake", "an old steam train")
#: PSNR of equal images (and the cap of any): a finite number to average
PSNR_CAP = 100.0
#: the goals (issue 32)
SHAPES_SHARE_GOAL, SHAPES_POINTS_GOAL = 0.40, 3
FLUX_TIME_GOAL, FLUX_PSNR_GOAL = 0.6, 30.0
BATCH_GOAL = 0.8


def log(msg: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- images ------------------------------------------------------------------------------------
def to_u8(image: Any) -> np.ndarray:
    """(H, W, 3) uint8 of a diffrt tensor in [-1, 1] (C, H, W) or a diffusers
    float array in [0, 1] (H, W, 3), rounded as diffusers' postprocessing does."""
    if isinstance(image, np.ndarray):
        return (np.clip(image, 0, 1) * 255).round().astype(np.uint8)
    x = (image.float() / 2 + 0.5).clamp(0, 1).permute(1, 2, 0).numpy()
    return (x * 255).round().astype(np.uint8)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return PSNR_CAP if mse == 0 else min(PSNR_CAP, 10 * math.log10(255.0 ** 2 / mse))


# -- what runs ---------------------------------------------------------------------------------
def eval_cases(model: str, n: int) -> list[tuple[str, int]]:
    """(prompt, seed) of the evaluated requests: diffrt-shapes' held-out
    prompts (every fifth, seeds 0..n-1, as its model card); prompts of their
    own on the random-weight models."""
    if model == "diffrt-shapes":
        from diffrt.demo.shapes import HELD_OUT

        return [(s.prompt, i) for i, s in enumerate(HELD_OUT[::5][:n])]
    return [(TINY_PROMPTS[i % len(TINY_PROMPTS)], i) for i in range(n)]


def fit_cases(model: str, n: int) -> list[tuple[str, int]]:
    """(prompt, seed) of the TeaCache fit: apart from the evaluation's (training
    scenes on diffrt-shapes, other seeds)."""
    if model == "diffrt-shapes":
        from diffrt.demo.shapes import TRAIN

        return [(s.prompt, 1000 + i) for i, s in enumerate(TRAIN[7::97][:n])]
    return [(f"{TINY_PROMPTS[(i + 3) % len(TINY_PROMPTS)]}, study {i}", 1000 + i)
            for i in range(n)]


class Runner:
    """One model's diffrt pipeline, in this process, one request a forward."""

    def __init__(self, model: str):
        import torch

        from diffrt.engine.models.registry import resolve_model_spec
        from diffrt.engine.pipelines.load import load_pipeline

        self.model, self.steps = model, FIT_STEPS.get(model, 28)
        self.spec = resolve_model_spec(model)
        self.pipe = load_pipeline(self.spec, device=torch.device("cpu"), dtype=torch.float32)
        transformer = self.pipe.eager_transformer
        self.blocks = [*getattr(transformer, "transformer_blocks", transformer.blocks),
                       *getattr(transformer, "single_transformer_blocks", [])]
        self.rescale: tuple[float, ...] = ()
        for cache in (None, FB, TC):  # warm: every path once
            self.run("warm", 0, cache, 0.1 if cache else None)

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    def with_rescale(self, coefficients: tuple[float, ...]) -> None:
        """TeaCache requests use ``coefficients`` from now on: the pipeline's
        spec with them as its checkpoint's fitted polynomial."""
        import msgspec

        self.rescale = tuple(coefficients)
        self.pipe.spec = msgspec.structs.replace(self.spec, cache=msgspec.structs.replace(
            self.spec.cache, teacache_rescale=self.rescale))

    def run(self, prompt: str, seed: int, cache: str | None = None,
            threshold: float | None = None) -> dict[str, Any]:
        """One request alone: its image, its cache metrics, its wall and stage seconds."""
        from diffrt.engine import DiffusionRequest, SamplingParams
        from diffrt.engine.pipelines.interface import DiffusionRequestBatch

        request = DiffusionRequest(prompt=prompt, request_id="r", sampling_params=SamplingParams(
            seed=seed, num_inference_steps=self.steps, cache=cache, cache_threshold=threshold))
        before = dict(stage_timers.TOTALS)
        start = time.perf_counter()
        image = self.pipe.forward(DiffusionRequestBatch([request]))[0][0]
        wall = time.perf_counter() - start
        metrics = self.pipe.take_cache_metrics().get("r")
        return {"image": to_u8(image) if image.dim() == 3 else image,  # a clip: as it is
                "cache": metrics, "wall": wall,
                **{k: stage_timers.TOTALS[k] - before[k] for k in before}}


def interleaved(configs: list[Any], rounds: int, measure: Callable[[Any], dict[str, float]]
                ) -> dict[Any, dict[str, list[float]]]:
    """``measure(config)`` for each config in each round, the order rotating."""
    out: dict[Any, dict[str, list[float]]] = {c: defaultdict(list) for c in configs}
    for rnd in range(rounds):
        k = rnd % len(configs)
        for config in configs[k:] + configs[:k]:
            for key, value in measure(config).items():
                out[config][key].append(value)
    return out


# -- 1. where the time goes --------------------------------------------------------------------
class BlockClock:
    """Seconds spent inside the transformer's blocks (forward hooks)."""

    def __init__(self, blocks: list[Any]):
        self.total, self._start = 0.0, 0.0
        self.handles = []
        for block in blocks:
            self.handles.append(block.register_forward_pre_hook(self._pre))
            self.handles.append(block.register_forward_hook(self._post))

    def _pre(self, *_: Any) -> None:
        self._start = time.perf_counter()

    def _post(self, *_: Any) -> None:
        self.total += time.perf_counter() - self._start

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def bench_stages(runners: dict[str, Runner], args: argparse.Namespace) -> dict[str, Any]:
    print(f"\n== 1. where the time goes (uncached, one request at a time, {args.stage_requests} "
          f"requests, median of {args.rounds} interleaved rounds; stage_timers) ==")
    clocks = {m: BlockClock(r.blocks) for m, r in runners.items()}

    def measure(model: str) -> dict[str, float]:
        runner, clock = runners[model], clocks[model]
        blocks0 = clock.total
        sums: dict[str, float] = defaultdict(float)
        for prompt, seed in fit_cases(model, args.stage_requests):
            for k, v in runner.run(prompt, seed).items():
                if isinstance(v, float):
                    sums[k] += v
        sums["blocks"] = clock.total - blocks0
        return {k: v / args.stage_requests for k, v in sums.items()}

    results = interleaved(list(runners), args.rounds, measure)
    for clock in clocks.values():
        clock.remove()
    print(f"{'model':<15}{'steps':>6}{'size':>9}{'rows':>6}{'blocks':>7}{'s/image':>9}"
          f"{'transformer':>13}{'(in blocks)':>12}{'vae':>7}{'text':>7}{'other':>7}")
    rows = {}
    for model, r in results.items():
        med = {k: median(v) for k, v in r.items()}
        runner = runners[model]
        d = runner.spec.defaults
        cfg = runner.spec.uses_cfg(runner.spec.with_defaults(_plain_request("x")))
        other = med["wall"] - med["transformer"] - med["vae"] - med["text"]
        rows[model] = {**med, "other": other}
        print(f"{model:<15}{runner.steps:>6}{f'{d.height}x{d.width}':>9}{2 if cfg else 1:>6}"
              f"{runner.n_blocks:>7}{med['wall']:>9.3f}{med['transformer'] / med['wall']:>13.0%}"
              f"{med['blocks'] / med['transformer']:>12.0%}{med['vae'] / med['wall']:>7.0%}"
              f"{med['text'] / med['wall']:>7.0%}{other / med['wall']:>7.0%}")
    print("(shares of the request's wall time; '(in blocks)': of the transformer's time, the "
          "part a step cache can skip; rows: transformer rows per request, 2 with CFG)")
    return rows


def _plain_request(prompt: str) -> Any:
    from diffrt.engine import DiffusionRequest

    return DiffusionRequest(prompt=prompt)


# -- 2. the TeaCache fit -----------------------------------------------------------------------
def fit_teacache(runner: Runner, n: int) -> dict[str, Any]:
    """x, y per step over ``n`` uncached requests and their degree-4 fit."""
    from diffrt.engine.cache.policies import relative_l1

    transformer = runner.pipe.eager_transformer
    seen: dict[str, list[Any]] = {"x": [], "y": []}

    def keep(key: str) -> Callable[..., None]:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            seen[key].append((output[0] if isinstance(output, tuple) else output).detach().clone())
        return hook

    if hasattr(transformer, "condition_embedder"):  # Wan: temb, of the expert that runs
        experts = [transformer, *[e for e in (getattr(runner.pipe, "transformer_2", None),)
                                  if e is not None]]
        handles = [h for e in experts for h in (
            e.condition_embedder.register_forward_hook(keep("x")),
            e.proj_out.register_forward_hook(keep("y")))]
    else:
        handles = [transformer.transformer_blocks[0].norm1.register_forward_hook(keep("x")),
                   transformer.proj_out.register_forward_hook(keep("y"))]
    xs, ys = [], []
    try:
        for prompt, seed in fit_cases(runner.model, n):
            seen["x"].clear()
            seen["y"].clear()
            runner.run(prompt, seed)
            assert len(seen["x"]) == len(seen["y"]) == runner.steps, (len(seen["x"]),
                                                                        len(seen["y"]))
            for i in range(1, runner.steps):
                xs.append(relative_l1(seen["x"][i], seen["x"][i - 1]))
                ys.append(relative_l1(seen["y"][i], seen["y"][i - 1]))
    finally:
        for h in handles:
            h.remove()
    x, y = np.array(xs), np.array(ys)

    def r2(coefficients: Any) -> float:
        fitted = np.polyval(coefficients, x)
        return 1 - float(((y - fitted) ** 2).sum() / ((y - y.mean()) ** 2).sum())

    coefficients = np.polyfit(x, y, FIT_DEGREE)
    quartic = np.polyfit(x, y, 4)
    # a line that falls with the change would invert it; one that explains
    # next to nothing (R^2 below MIN_FIT_R2) is a constant, not a calibration
    usable = coefficients[0] > 0 and r2(coefficients) >= MIN_FIT_R2
    return {"coefficients": tuple(float(c) for c in coefficients) if usable else (),
            "points": len(xs), "x": (float(x.min()), float(x.max())),
            "y": (float(y.min()), float(y.max())), "r2": r2(coefficients),
            "r2_quartic": r2(quartic), "quartic_at_4x": float(np.polyval(quartic, 4 * x.max())),
            "mean_x": float(x.mean()), "mean_y": float(y.mean())}


def bench_fit(runners: dict[str, Runner], args: argparse.Namespace) -> dict[str, Any]:
    print(f"\n== 2. TeaCache's rescaling polynomial, fitted per model ({args.fit_requests} "
          f"uncached requests each, prompts and seeds apart from the evaluation's) ==")
    print("x: relative L1 change of transformer_blocks[0].norm1's modulated image input "
          "(Wan: of the time embedding temb) "
          f"between steps; y: of the transformer's output (proj_out); numpy.polyfit(x, y, "
          f"{FIT_DEGREE}) (TeaCache's authors fit degree 4 over their checkpoints' range; "
          "over these narrow ranges a quartic fits no better and turns negative beyond them, "
          "where requests of fewer steps land: its value at 4x the largest x is printed)")
    fits = {}
    for model, runner in runners.items():
        fit = fit_teacache(runner, args.fit_requests)
        fits[model] = fit
        runner.with_rescale(fit["coefficients"])
        print(f"{model:<15}{fit['points']:>4} points, x {fit['x'][0]:.4f}..{fit['x'][1]:.4f} "
              f"(mean {fit['mean_x']:.4f}), y {fit['y'][0]:.4f}..{fit['y'][1]:.4f} "
              f"(mean {fit['mean_y']:.4f}), R^2 {fit['r2']:.3f} (quartic {fit['r2_quartic']:.3f},"
              f" which gives {fit['quartic_at_4x']:.3g} at 4x the largest x)"
              + ("" if fit["coefficients"] else
                 f"; not used (a falling line, or R^2 below {MIN_FIT_R2}): the distance as it is"))
    print("copy-paste (CacheSupport(teacache_rescale=...), highest power first):")
    for model, fit in fits.items():
        print(f'    "{model}": (' + ", ".join(f"{c:.8e}" for c in fit["coefficients"]) + "),")
    print("(the TeaCache runs below use these: each runner's pipeline.spec is "
          "msgspec.structs.replace(spec, cache=msgspec.structs.replace(spec.cache, "
          "teacache_rescale=coefficients)))")
    return fits


# -- 3. quality and savings ----------------------------------------------------------------------
def quality_run(runner: Runner, cases: list[tuple[str, int]], cache: str | None,
                threshold: float | None) -> dict[str, Any]:
    """Every case once: images, steps reused, stage seconds."""
    images, reused, steps = [], 0, 0
    sums: dict[str, float] = defaultdict(float)
    for prompt, seed in cases:
        out = runner.run(prompt, seed, cache, threshold)
        images.append(out["image"])
        for k in ("wall", "transformer"):
            sums[k] += out[k]
        m = out["cache"]
        if cache is not None:
            assert m is not None and m.uncached_reason is None, m
            reused += m.steps_reused
            steps += m.steps_reused + m.steps_computed
    return {"images": images, "share": reused / steps if steps else 0.0, **sums}


def block_share(policy: str, share: float, n_blocks: int) -> float:
    """Share of all block evaluations skipped, from the share of steps reused."""
    return share * (n_blocks - 1) / n_blocks if policy == FB else share


def bench_shapes(runner: Runner, args: argparse.Namespace) -> dict[str, Any]:
    from diffrt.demo.shapes import ATTRIBUTES, HELD_OUT, tally

    cases = eval_cases("diffrt-shapes", args.shapes_prompts)
    scenes = HELD_OUT[::5][:len(cases)]
    n = len(cases)
    print(f"\n== 3a. diffrt-shapes (64x64, {runner.steps} steps, true CFG 3; {runner.n_blocks} "
          f"blocks): the classifier on {n} held-out prompts, seeds 0..{n - 1}, counts out "
          f"of {n} ==")
    results: dict[tuple[str, float | None], dict[str, Any]] = {}

    def get(policy: str | None, threshold: float | None) -> dict[str, Any]:
        key = (policy or "off", threshold)
        if key not in results:
            r = quality_run(runner, cases, policy, threshold)
            r["tally"] = tally(scenes, r["images"])
            results[key] = r
        return results[key]

    base = get(None, None)
    print(f"{'policy':<13}{'threshold':>10}" + "".join(f"{a:>11}" for a in ATTRIBUTES)
          + f"{'steps reused':>14}{'of all blocks':>15}{'PSNR dB':>9}{'xformer':>9}")

    def line(policy: str, threshold: float | None, r: dict[str, Any]) -> None:
        hits = r["tally"]
        if policy == "off":
            deltas = [f"{hits[a]:>11}" for a in ATTRIBUTES]
            extra = f"{'-':>14}{'-':>15}{'-':>9}{1.0:>9.2f}"
        else:
            deltas = [f"{hits[a]:>5} ({hits[a] - base['tally'][a]:+d})" for a in ATTRIBUTES]
            p = float(np.mean([psnr(a, b) for a, b in zip(r["images"], base["images"],
                                                           strict=True)]))
            extra = (f"{r['share']:>14.0%}{block_share(policy, r['share'], runner.n_blocks):>15.0%}"
                     f"{p:>9.1f}{r['transformer'] / base['transformer']:>9.2f}")
        print(f"{policy:<13}{'-' if threshold is None else f'{threshold:g}':>10}"
              + "".join(deltas) + extra)

    line("off", None, base)
    for policy in POLICY_NAMES:
        for threshold in THRESHOLDS["diffrt-shapes"][policy]:
            line(policy, threshold, get(policy, threshold))
    print("(steps reused = the share of skippable block evaluations reused: First-Block Cache "
          f"skips {runner.n_blocks - 1} of {runner.n_blocks} blocks, TeaCache all; "
          "PSNR: mean over the prompts against uncached, capped at 100; xformer: transformer "
          "seconds cached / uncached, one pass, indicative)")
    sweep: dict[str, list[dict[str, Any]]] = {}
    if args.sweep:
        print(f"\nsweep (the goal: >= {SHAPES_SHARE_GOAL:.0%} of skippable block evaluations "
              f"reused, every attribute within {SHAPES_POINTS_GOAL} of uncached):")
        for policy in POLICY_NAMES:
            sweep[policy] = []
            for threshold in sorted(set(SWEEP[policy]) | set(THRESHOLDS["diffrt-shapes"][policy])):
                r = get(policy, threshold)
                worst = min(r["tally"][a] - base["tally"][a] for a in ATTRIBUTES)
                ok = r["share"] >= SHAPES_SHARE_GOAL and worst >= -SHAPES_POINTS_GOAL
                sweep[policy].append({"threshold": threshold, "share": r["share"],
                                      "worst_delta": worst, "meets": ok})
            print(f"  {policy:<12}" + "  ".join(
                f"{s['threshold']:g}: {s['share']:.0%} {s['worst_delta']:+d}"
                f"{' *' if s['meets'] else ''}" for s in sweep[policy]))
        print("  (threshold: steps reused, worst attribute's change in counts; * meets the goal)")
    return {"base": base, "results": results, "sweep": sweep, "n": n}


def bench_psnr_time(runner: Runner, args: argparse.Namespace) -> dict[str, Any]:
    model = runner.model
    cases = eval_cases(model, args.tiny_requests)
    d = runner.spec.defaults
    print(f"\n== 3b. {model} ({d.height}x{d.width}, {runner.steps} steps, {runner.n_blocks} "
          f"blocks): PSNR against uncached ({len(cases)} seeds) and transformer time, "
          f"median of {args.rounds} interleaved rounds ==")
    configs: list[tuple[str, float | None]] = [("off", None)] + [
        (p, t) for p in POLICY_NAMES for t in THRESHOLDS[model][p]]
    images: dict[Any, list[np.ndarray]] = {}
    shares: dict[Any, float] = {}

    def measure(config: tuple[str, float | None]) -> dict[str, float]:
        policy, threshold = config
        r = quality_run(runner, cases, None if policy == "off" else policy, threshold)
        images.setdefault(config, r["images"])
        shares[config] = r["share"]
        return {"wall": r["wall"], "transformer": r["transformer"]}

    timed = interleaved(configs, args.rounds, measure)
    med = {c: {k: median(v) for k, v in timed[c].items()} for c in configs}
    base = med[("off", None)]
    print(f"{'policy':<13}{'threshold':>10}{'steps reused':>14}{'of all blocks':>15}"
          f"{'PSNR dB':>9}{'(min)':>7}{'xformer s':>11}{'ratio':>7}{'wall ratio':>12}")
    rows = {}
    for config in configs:
        policy, threshold = config
        p = [psnr(a, b) for a, b in zip(images[config], images[("off", None)], strict=True)]
        ratio = med[config]["transformer"] / base["transformer"]
        rows[config] = {"share": shares[config], "psnr": float(np.mean(p)),
                        "psnr_min": float(np.min(p)), "ratio": ratio,
                        "wall_ratio": med[config]["wall"] / base["wall"]}
        if policy == "off":
            print(f"{policy:<13}{'-':>10}{'-':>14}{'-':>15}{'-':>9}{'-':>7}"
                  f"{med[config]['transformer']:>11.3f}{1.0:>7.2f}{1.0:>12.2f}")
            continue
        print(f"{policy:<13}{threshold:>10g}{shares[config]:>14.0%}"
              f"{block_share(policy, shares[config], runner.n_blocks):>15.0%}"
              f"{rows[config]['psnr']:>9.1f}{rows[config]['psnr_min']:>7.1f}"
              f"{med[config]['transformer']:>11.3f}{ratio:>7.2f}{rows[config]['wall_ratio']:>12.2f}")
    print(f"(xformer s: transformer seconds for the {len(cases)} requests (stage timers: "
          "FlowMatchPipeline.run_transformer); ratio: cached / uncached; wall ratio: the "
          "requests' whole time, VAE and text included; PSNR mean and min over the seeds, "
          "capped at 100)")
    return {"rows": rows, "images": images}


# -- 4. step mode x8 ---------------------------------------------------------------------------
def bench_step_batch(args: argparse.Namespace) -> dict[str, Any]:
    from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams

    steps, n, cached = 28, 8, (1, 3, 5, 7)
    print(f"\n== 4. step mode x8 on tiny-flux (128x128, {steps} steps): 8 requests at once, "
          f"4 of them first-block at the default threshold; median of {args.batch_rounds} "
          f"interleaved rounds ==")
    engine = DiffusionEngine.make_engine(EngineConfig(
        model="tiny-flux", executor_backend="inproc", step_execution=True, max_num_seqs=n,
        warmup=False, torch_threads=args.torch_threads or None))
    counter = iter(range(10 ** 9))
    reused: dict[str, list[int]] = defaultdict(list)

    def request(i: int, cache: bool) -> Any:
        return DiffusionRequest(prompt=TINY_PROMPTS[i % len(TINY_PROMPTS)] + f" {i}",
                                request_id=f"q{next(counter)}",
                                sampling_params=SamplingParams(
                                    num_inference_steps=steps, seed=i,
                                    cache=FB if cache else None))

    def go(reqs: list[Any], tag: str) -> dict[str, float]:
        before = dict(stage_timers.TOTALS)
        start = time.perf_counter()
        outs = engine.generate(reqs, timeout=600)
        wall = time.perf_counter() - start
        bad = [o.error for o in outs if not o.ok]
        if bad:
            raise RuntimeError(f"{len(bad)} requests failed: {bad[0]}")
        reused[tag].append(sum(o.metrics.cache.steps_reused for o in outs
                               if o.metrics.cache is not None))
        return {"wall": wall, "transformer": stage_timers.TOTALS["transformer"]
                - before["transformer"]}

    configs = ["x8 uncached", "x8 half cached"] + [f"solo {i} {c}" for i in cached
                                                   for c in ("uncached", "cached")]

    def measure(config: str) -> dict[str, float]:
        if config == "x8 uncached":
            return go([request(i, False) for i in range(n)], config)
        if config == "x8 half cached":
            return go([request(i, i in cached) for i in range(n)], config)
        _, i, kind = config.split()
        return go([request(int(i), kind == "cached")], config)

    try:
        go([request(i, i in cached) for i in range(n)], "warm")  # every prompt, both paths
        go([request(i, False) for i in range(n)], "warm")
        timed = interleaved(configs, args.batch_rounds, measure)
    finally:
        engine.close()
    med = {c: {k: median(v) for k, v in timed[c].items()} for c in configs}
    figures = {}
    for key in ("wall", "transformer"):
        batch = med["x8 uncached"][key] - med["x8 half cached"][key]
        solo = sum(med[f"solo {i} uncached"][key] - med[f"solo {i} cached"][key] for i in cached)
        # what one row of the uncached x8 batch costs, against one request alone
        row = (med["x8 uncached"][key] / n) / median(
            [med[f"solo {i} uncached"][key] for i in cached])
        ratio = batch / solo if solo > 0 else float("nan")
        figures[key] = {"batch_saving": batch, "solo_savings": solo, "ratio": ratio,
                        "x8_uncached": med["x8 uncached"][key],
                        "x8_half": med["x8 half cached"][key], "row_cost": row,
                        "ratio_over_row_cost": ratio / row}
    print(f"{'':<14}{'x8 uncached s':>15}{'x8 half cached s':>18}{'saved s':>9}"
          f"{'sum of 4 solo savings s':>25}{'ratio':>7}{'x8 row / solo':>15}{'ratio / that':>14}")
    for key, f in figures.items():
        print(f"{key:<14}{f['x8_uncached']:>15.3f}{f['x8_half']:>18.3f}{f['batch_saving']:>9.3f}"
              f"{f['solo_savings']:>25.3f}{f['ratio']:>7.2f}{f['row_cost']:>15.2f}"
              f"{f['ratio_over_row_cost']:>14.2f}")
    print("(x8 row / solo: a row of the uncached x8 batch costs that share of a request run "
          "alone (batching's own gain), so skipping the same steps inside the batch can save "
          "about that share of the solo savings; ratio / that: the saving against that ceiling)")
    solo_reused = [reused[f"solo {i} cached"][0] for i in cached]
    print(f"steps reused by the 4 cached requests: {reused['x8 half cached'][0]} of "
          f"{4 * steps} in the batch, {sum(solo_reused)} alone ({', '.join(map(str, solo_reused))})"
          f"; wall: engine.generate of the requests; transformer: the stage timers' seconds")
    return figures


# -- 5. the diffusers peer ------------------------------------------------------------------------
#: diffusers' First-Block Cache head-block decisions (True: compute), in call order
PEER_DECISIONS: list[bool] = []


def _count_peer_decisions() -> None:
    from diffusers.hooks import first_block_cache as fbc

    original = fbc.FBCHeadBlockHook._should_compute_remaining_blocks
    if getattr(original, "__counted__", False):
        return

    def counted(self: Any, residual: Any) -> bool:
        compute = original(self, residual)
        PEER_DECISIONS.append(bool(compute))
        return compute

    counted.__counted__ = True  # type: ignore[attr-defined]
    fbc.FBCHeadBlockHook._should_compute_remaining_blocks = counted


class Peer:
    """diffusers' FluxPipeline on the model's folder, one prompt a call."""

    def __init__(self, model: str):
        import diffusers
        import torch
        import transformers

        from diffrt.engine.models.registry import resolve_model_spec

        _count_peer_decisions()
        self.model, self.steps = model, MODELS[model]
        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
        self.pipe = diffusers.FluxPipeline.from_pretrained(resolve_model_spec(model).folder,
                                                           dtype=torch.float32)
        self.pipe.set_progress_bar_config(disable=True)
        self.size = resolve_model_spec(model).defaults.height
        self.run([("warm", 0)], None)

    def run(self, cases: list[tuple[str, int]], threshold: float | None
            ) -> tuple[list[np.ndarray], float]:
        """Images and the share of head-block decisions that skipped (per branch)."""
        import torch
        from diffusers.hooks import FirstBlockCacheConfig

        transformer = self.pipe.transformer
        if threshold is not None:
            transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        images = []
        del PEER_DECISIONS[:]
        try:
            for prompt, seed in cases:
                out = self.pipe(prompt=prompt, height=self.size, width=self.size,
                                num_inference_steps=self.steps, output_type="np",
                                generator=torch.Generator().manual_seed(seed),
                                **PEER_KWARGS[self.model]).images[0]
                images.append(to_u8(out))
        finally:
            if threshold is not None:
                transformer.disable_cache()
        decisions = list(PEER_DECISIONS)
        share = (decisions.count(False) / len(decisions)) if decisions else 0.0
        return images, share


def _curve(points: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """(shares, qualities) sorted by share, qualities of equal shares averaged."""
    by: dict[float, list[float]] = defaultdict(list)
    for share, quality in points:
        by[round(share, 6)].append(quality)
    xs = sorted(by)
    return np.array(xs), np.array([float(np.mean(by[x])) for x in xs])


def bench_peer(shapes: dict[str, Any] | None, flux: dict[str, Any] | None,
               args: argparse.Namespace) -> dict[str, Any]:
    from diffrt.demo.shapes import ATTRIBUTES, HELD_OUT, tally

    print(f"\n== 5. the peer: diffusers' FirstBlockCacheConfig (transformer.enable_cache) on the "
          f"same folders, thresholds {', '.join(f'{t:g}' for t in args.peer_thresholds)}; "
          "compared at diffrt first-block's shares (the peer's quality interpolated over its "
          "share) ==")
    print("diffusers decides per CFG branch (each of diffrt-shapes' cond/uncond transformer "
          "calls skips on its own: its share is of branch-steps); diffrt per request (both "
          "rows together)")
    figures: dict[str, Any] = {}
    if flux is not None:
        peer = Peer("tiny-flux")
        cases = eval_cases("tiny-flux", args.tiny_requests)
        ref, _ = peer.run(cases, None)
        parity = float(np.mean([psnr(a, b) for a, b in zip(
            ref, flux["images"][("off", None)], strict=True)]))
        points = []
        print(f"\ntiny-flux ({peer.steps} steps, {len(cases)} seeds): diffusers uncached against "
              f"diffrt uncached: PSNR {parity:.1f} dB (parity)")
        print(f"{'diffusers threshold':<22}{'steps skipped':>15}{'PSNR dB':>9}")
        for threshold in args.peer_thresholds:
            images, share = peer.run(cases, threshold)
            p = float(np.mean([psnr(a, b) for a, b in zip(images, ref, strict=True)]))
            points.append((share, p))
            print(f"{threshold:<22g}{share:>15.0%}{p:>9.1f}")
        xs, ys = _curve(points)
        rows = []
        print(f"{'diffrt first-block':<22}{'steps skipped':>15}{'PSNR dB':>9}"
              f"{'peer at that share':>20}{'diff':>7}")
        for threshold in THRESHOLDS["tiny-flux"][FB]:
            r = flux["rows"][(FB, threshold)]
            at = float(np.interp(r["share"], xs, ys))
            inside = bool(xs[0] - 1e-6 <= r["share"] <= xs[-1] + 1e-6)
            rows.append({"threshold": threshold, "share": r["share"], "psnr": r["psnr"],
                         "peer_psnr": at, "inside": inside})
            print(f"{threshold:<22g}{r['share']:>15.0%}{r['psnr']:>9.1f}{at:>20.1f}"
                  f"{r['psnr'] - at:>+7.1f}{'' if inside else '  (beyond the peer range)'}")
        figures["tiny-flux"] = {"peer": points, "compare": rows, "parity_psnr": parity}
        del peer
    if shapes is not None:
        peer = Peer("diffrt-shapes")
        n = shapes["n"]
        cases = eval_cases("diffrt-shapes", n)
        scenes = HELD_OUT[::5][:n]
        ref, _ = peer.run(cases, None)
        base = tally(scenes, ref)
        print(f"\ndiffrt-shapes ({peer.steps} steps, {n} held-out prompts, counts out of {n}; "
              f"total of the 4 attributes out of {4 * n}):")
        print(f"{'diffusers threshold':<22}{'branch-steps skipped':>22}"
              + "".join(f"{a:>11}" for a in ATTRIBUTES) + f"{'total':>7}")
        print(f"{'uncached':<22}{'-':>22}" + "".join(f"{base[a]:>11}" for a in ATTRIBUTES)
              + f"{sum(base.values()):>7}")
        points = []
        for threshold in args.peer_thresholds:
            images, share = peer.run(cases, threshold)
            hits = tally(scenes, images)
            points.append((share, float(sum(hits.values()))))
            print(f"{threshold:<22g}{share:>22.0%}" + "".join(f"{hits[a]:>11}" for a in ATTRIBUTES)
                  + f"{sum(hits.values()):>7}")
        xs, ys = _curve(points)
        rows = []
        ours_base = sum(shapes["base"]["tally"].values())
        print(f"{'diffrt first-block':<22}{'steps skipped':>22}{'total':>7}{'(uncached)':>11}"
              f"{'peer at that share':>20}{'diff':>7}")
        for threshold in THRESHOLDS["diffrt-shapes"][FB]:
            r = shapes["results"][(FB, threshold)]
            total = sum(r["tally"].values())
            at = float(np.interp(r["share"], xs, ys))
            inside = bool(xs[0] - 1e-6 <= r["share"] <= xs[-1] + 1e-6)
            rows.append({"threshold": threshold, "share": r["share"], "total": total,
                         "peer_total": at, "inside": inside})
            print(f"{threshold:<22g}{r['share']:>22.0%}{total:>7}{ours_base:>11}{at:>20.1f}"
                  f"{total - at:>+7.1f}{'' if inside else '  (beyond the peer range)'}")
        print(f"(the peer's own uncached total: {sum(base.values())})")
        figures["diffrt-shapes"] = {"peer": points, "compare": rows}
    return figures


# -- 6. goals ------------------------------------------------------------------------------------
def default_threshold(model: str, policy: str) -> float:
    """The threshold a request naming none gets on ``model``."""
    from diffrt.engine.cache.policies import DEFAULT_THRESHOLDS
    from diffrt.engine.models.registry import resolve_model_spec

    return resolve_model_spec(model).cache.thresholds.get(policy, DEFAULT_THRESHOLDS[policy])


def report_goals(shapes: dict[str, Any] | None, tiny: dict[str, dict[str, Any]],
                 batch: dict[str, Any] | None, peer: dict[str, Any]) -> dict[str, Any]:
    from diffrt.demo.shapes import ATTRIBUTES

    print("\n== 6. goals (at each model's default threshold: its registry entry's "
          "calibration, else the policy's) ==")
    goals: dict[str, Any] = {}
    if shapes is not None:
        base = shapes["base"]["tally"]
        swept = {(policy, s["threshold"]): s for policy, sweep in shapes["sweep"].items()
                 for s in sweep}
        for policy in POLICY_NAMES:
            threshold = default_threshold("diffrt-shapes", policy)
            r = shapes["results"].get((policy, threshold))
            if r is not None:
                worst = min(r["tally"][a] - base[a] for a in ATTRIBUTES)
                share = r["share"]
            elif (policy, threshold) in swept:
                worst, share = swept[(policy, threshold)]["worst_delta"], swept[(policy, threshold)]["share"]
            else:
                continue
            r = {"share": share}
            ok = r["share"] >= SHAPES_SHARE_GOAL and worst >= -SHAPES_POINTS_GOAL
            goals[f"diffrt-shapes {policy} default"] = ok
            print(f"diffrt-shapes, {policy} at the default threshold {threshold:g}: "
                  f"{r['share']:.0%} of skippable block evaluations reused (goal >= "
                  f"{SHAPES_SHARE_GOAL:.0%}), worst attribute {worst:+d} of {shapes['n']} "
                  f"(goal >= -{SHAPES_POINTS_GOAL}): {'met' if ok else 'NOT met'}")
        for policy, sweep in shapes["sweep"].items():
            meeting = [s["threshold"] for s in sweep if s["meets"]]
            print(f"  thresholds that meet it, {policy}: "
                  f"{', '.join(f'{t:g}' for t in meeting) or 'none of those swept'}")
    for model, t in tiny.items():
        for policy in POLICY_NAMES:
            meeting = [(thr, r) for (p, thr), r in t["rows"].items()
                       if p == policy and r["ratio"] <= FLUX_TIME_GOAL
                       and r["psnr"] >= FLUX_PSNR_GOAL]
            threshold = default_threshold(model, policy)
            r = t["rows"].get((policy, threshold))
            label = "goal" if model == "tiny-flux" else "tiny-flux's goal, applied"
            if r is not None:
                ok = r["ratio"] <= FLUX_TIME_GOAL and r["psnr"] >= FLUX_PSNR_GOAL
                goals[f"{model} {policy} default"] = ok
                print(f"{model} 28 steps, {policy} at the default threshold {threshold:g}: "
                      f"transformer time {r['ratio']:.2f}x uncached at PSNR {r['psnr']:.1f} dB "
                      f"({label}: <= {FLUX_TIME_GOAL}x at >= {FLUX_PSNR_GOAL:g} dB): "
                      f"{'met' if ok else 'NOT met'}")
            print(f"  thresholds that meet it, {policy}: " + (", ".join(
                f"{thr:g} ({r['ratio']:.2f}x, {r['psnr']:.1f} dB)" for thr, r in meeting)
                or "none of those measured"))
    if batch is not None:
        for key in ("wall", "transformer"):
            ok = batch[key]["ratio"] >= BATCH_GOAL
            if key == "wall":
                goals["step x8 saving"] = ok
            print(f"step x8, half cached: {key} saved {batch[key]['ratio']:.2f}x the sum of the "
                  f"solo savings (goal >= {BATCH_GOAL}): {'met' if ok else 'NOT met'}"
                  + (" (judged on wall time)" if key == "wall" else " (for information)"))
    for model, fig in peer.items():
        key = "psnr" if model == "tiny-flux" else "total"
        compared = [c for c in fig["compare"] if c["share"] > 0 and c["inside"]]
        # PSNR within the 0.05 dB it is printed to is the same image quality
        slack = 0.05 if key == "psnr" else 0.0
        ok = all(c[key] >= c[f"peer_{key}"] - slack for c in compared) if compared else None
        goals[f"{model} vs diffusers"] = ok
        what = "PSNR" if key == "psnr" else "classifier hits (4 attributes)"
        print(f"{model}: first-block {what} at diffusers' share no worse than diffusers' "
              f"hooks: " + ("nothing to compare (no skip within the peer's range)" if ok is None
                            else ("met" if ok else "NOT met")) + " (" + ", ".join(
                f"{c['threshold']:g}: {c[key]:.1f} vs {c[f'peer_{key}']:.1f} at {c['share']:.0%}"
                for c in fig["compare"]) + ")")
    return goals


# -- the run -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run (about a minute): few prompts, one round, no sweep")
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds (sections 1, 3b)")
    ap.add_argument("--batch-rounds", type=int, default=5, help="rounds of section 4")
    ap.add_argument("--shapes-prompts", type=int, default=30)
    ap.add_argument("--tiny-requests", type=int, default=4,
                    help="seeds per configuration on tiny-flux and tiny-sd3")
    ap.add_argument("--stage-requests", type=int, default=4)
    ap.add_argument("--fit-requests", type=int, default=16)
    ap.add_argument("--no-sweep", dest="sweep", action="store_false",
                    help="skip diffrt-shapes' finer threshold sweep")
    ap.add_argument("--skip", nargs="*", default=[], choices=["stages", "shapes", "tiny",
                                                              "batch", "peer"])
    ap.add_argument("--torch-threads", type=int, default=1, metavar="N",
                    help="torch threads (default 1; 0: torch's default)")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--fit-only", nargs="+", metavar="MODEL",
                    help="section 2 alone, for these models (tiny-wan, or any registered "
                         "model without a published polynomial)")
    args = ap.parse_args(argv)
    args.peer_thresholds = PEER_THRESHOLDS
    if args.quick:
        args.rounds, args.batch_rounds = 1, 1
        args.shapes_prompts, args.tiny_requests, args.stage_requests, args.fit_requests = 6, 1, 1, 3
        args.sweep, args.peer_thresholds = False, (0.1, 0.3)
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    start = time.perf_counter()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, torch threads "
          f"{torch.get_num_threads()}; float32, in process")
    log("loading the pipelines")
    if args.fit_only:
        bench_fit({m: Runner(m) for m in args.fit_only}, args)
        print(f"\n(whole run {time.perf_counter() - start:.0f} s)")
        return 0
    runners = {m: Runner(m) for m in MODELS}
    skip = set(args.skip)
    if "stages" not in skip:
        bench_stages(runners, args)
    log("fitting TeaCache")
    fits = bench_fit(runners, args)
    shapes = None if "shapes" in skip else bench_shapes(runners["diffrt-shapes"], args)
    log("3b")
    tiny = {} if "tiny" in skip else {m: bench_psnr_time(runners[m], args)
                                      for m in ("tiny-flux", "tiny-sd3")}
    del runners
    log("4")
    batch = None if "batch" in skip else bench_step_batch(args)
    log("5")
    peer = {} if "peer" in skip else bench_peer(shapes, tiny.get("tiny-flux"), args)
    goals = report_goals(shapes, tiny, batch, peer)
    print(f"\n(whole run {time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_jsonable({"fits": fits, "goals": goals, "batch": batch, "peer": peer,
                                 "tiny": {m: t["rows"] for m, t in tiny.items()},
                                 "shapes": None if shapes is None else {
                                     f"{k[0]} {k[1]}": {"share": r["share"], "tally": r["tally"]}
                                     for k, r in shapes["results"].items()}}), f, indent=2)
    return 0


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {(k if isinstance(k, str) else " ".join(map(str, k)) if isinstance(k, tuple)
                 else str(k)): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, Iterable) and not isinstance(x, str):
        return [_jsonable(v) for v in x]
    return x


import stage_timers  # noqa: E402  (after HERE is on sys.path)

if __name__ == "__main__":
    sys.exit(main())
