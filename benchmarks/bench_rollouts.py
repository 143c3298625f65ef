"""Rollout throughput for reinforcement learning: diffrt against diffusers (issue 51).

A GRPO-shaped load: ``--prompts`` prompts (16) x ``--seeds`` seeds (8) with
Flow-GRPO's SDE sampler, every sample with its per-step log-probs and its
trajectory, half the prompts with LoRA adapter A and half with B (rank 16,
Flow-GRPO's Flux targets: attention and feed-forward), on ``diffrt-shapes``
at its defaults (64x64, 12 steps, true CFG 3 against ""), float32 in both.
diffrt-shapes and not tiny-flux: it is the model examples/grpo_shapes.py
trains, with trained text encoders and a non-distilled transformer whose
true CFG doubles the rows, as a real rollout's; tiny-flux's random 32-wide
transformer would measure little but overhead.

Three systems, each in a fresh process a round, the order rotating between
rounds, the median of ``--rounds`` printed; nothing asserted:

- ``diffrt``: step execution (``max_num_seqs`` = the prompts), the default
  mixed batching; one request a prompt (``seeds=[...]``, ``sampler="flow-sde"``,
  ``return_log_probs``, ``return_trajectory``, ``loras={A or B: 1.0}``), all
  submitted at once: the two adapters' groups share every step.
- ``diffrt deterministic``: the same with ``deterministic=True`` (each
  request's rows computed apart, so batching changes no bit): its cost.
- ``diffusers``: ``FluxPipeline`` with both adapters loaded, rolling out as
  Flow-GRPO's trainer does: a pipeline call per prompt group
  (``num_images_per_prompt`` = the seeds, a generator per seed) with its
  adapter set (``set_adapters``), the pipeline's own denoise loop with its
  scheduler's step replaced by the SDE step and its log-prob
  (``FlowSDEScheduler``, written here from the paper as Flow-GRPO patches the
  pipeline), keeping each step's latents and log-probs.

Both draw their noise the same way (per seed, in the VAE's latent layout:
the first latents, then each step's), so they compute the same samples: the
run prints the largest difference of the first group's log-probs between
diffrt and diffusers as a check. Samples/s is samples with log-probs per
second of wall time, from submission to the last output (diffrt) or over
the pipeline calls (diffusers). Goal: diffrt / diffusers >= 1.5.

diffrt runs its default multiprocess executor (one CPU worker). Run from the
repository root:

    .venv/bin/python benchmarks/bench_rollouts.py                  # 16 x 8, 3 rounds
    .venv/bin/python benchmarks/bench_rollouts.py --quick          # 4 x 2, 3 steps, 1 round
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from diffrt.cli.bench_stats import median

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MODEL = "diffrt-shapes"
SYSTEMS = ("diffrt", "diffrt deterministic", "diffusers")
ADAPTERS = {"A": 1, "B": 2}  # name -> seed
RANK = 16
TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
           "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj",
           "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
NOISE_LEVEL = 0.7
CFG = 3.0  # diffrt-shapes' default true CFG against "" (both systems)
SIZE = 64


def groups(prompts: int, seeds: int) -> list[tuple[str, str, list[int]]]:
    """(prompt, adapter, seeds) of every group: the first half A, the rest B."""
    from diffrt.demo.shapes import TRAIN

    step = max(1, len(TRAIN) // prompts)
    return [(TRAIN[i * step].prompt, "A" if i < prompts / 2 else "B",
             [1000 * i + j for j in range(seeds)]) for i in range(prompts)]


def make_adapters(out: Path) -> dict[str, str]:
    sys.path.insert(0, os.path.join(ROOT, "tests", "engine"))
    from lora_files import make_adapter  # the tests' offline adapter maker

    from diffrt.engine.models.shipped import shipped_folder

    return {name: make_adapter(shipped_folder(MODEL), "FluxPipeline", out / name,
                               targets=TARGETS, rank=RANK, seed=seed, magnitude=0.2)
            for name, seed in ADAPTERS.items()}


# -- diffrt ----------------------------------------------------------------------------------
def diffrt_requests(load: list[tuple[str, str, list[int]]], steps: int, *,
                    deterministic: bool) -> list[Any]:
    from diffrt.engine import DiffusionRequest, SamplingParams

    return [DiffusionRequest(prompt=prompt, sampling_params=SamplingParams(
        num_outputs_per_prompt=len(seeds), seeds=seeds, num_inference_steps=steps,
        sampler="flow-sde", noise_level=NOISE_LEVEL, loras={adapter: 1.0},
        return_log_probs=True, return_trajectory=True, deterministic=deterministic))
        for prompt, adapter, seeds in load]


def _diffrt_run(spec: dict[str, Any]) -> dict[str, Any]:
    from diffrt.engine import DiffusionEngine, EngineConfig

    load = groups(spec["prompts"], spec["seeds"])
    deterministic = spec["system"] == "diffrt deterministic"
    extra = {"torch_threads": spec["threads"]} if spec.get("threads") else {}
    engine = DiffusionEngine.make_engine(EngineConfig(
        model=MODEL, step_execution=True, max_num_seqs=len(load), dtype="float32",
        lora_modules=spec["adapters"], **extra))
    try:
        # one small group per adapter: kernels, both adapters' rows
        warm = [(p, a, s[:2]) for p, a, s in (load[0], load[-1])]
        check(engine.generate(diffrt_requests(warm, 2, deterministic=deterministic)))
        start = time.perf_counter()
        outs = engine.generate(diffrt_requests(load, spec["steps"], deterministic=deterministic))
        wall = time.perf_counter() - start
    finally:
        engine.close()
    check(outs)
    for out, (_, _, seeds) in zip(outs, load, strict=True):
        assert out.rollout.log_probs.shape == (len(seeds), spec["steps"])
    return {"wall": wall, "samples": sum(len(s) for _, _, s in load),
            "first_log_probs": outs[0].rollout.log_probs.tolist()}


def check(outs: list[Any]) -> None:
    failed = [o.error for o in outs if not o.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")


# -- diffusers, as Flow-GRPO's trainer rolls out -----------------------------------------------
def flow_sde_scheduler(config: Any) -> Any:
    """A ``FlowMatchEulerDiscreteScheduler`` whose ``step`` is Flow-GRPO's SDE
    step (eq. 9), keeping each step's latents and per-sample log-prob (the
    per-element mean). ``begin(generators, height, width)`` before each
    pipeline call: one CPU generator per sample, as the call's own."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    class FlowSDEScheduler(FlowMatchEulerDiscreteScheduler):
        def begin(self, generators: list[Any], latent_h: int, latent_w: int) -> None:
            self.generators, self.latent_hw = generators, (latent_h, latent_w)
            self.latents: list[Any] = []
            self.log_probs: list[Any] = []

        def noise(self, like: Any) -> Any:
            """eps per sample, drawn in the VAE's layout from its generator, packed."""
            h, w = self.latent_hw
            channels = like.shape[-1] // 4
            draws = [torch.randn((1, channels, h, w), generator=g) for g in self.generators]
            return FluxPipeline._pack_latents(torch.cat(draws), len(draws), channels, h, w)

        def step(self, model_output: Any, timestep: Any, sample: Any, *args: Any,
                 return_dict: bool = True, **kwargs: Any) -> Any:
            if self.step_index is None:
                self._init_step_index(timestep)
            if not self.latents:
                self.latents.append(sample)
            i = self.step_index
            sigma, sigma_next = float(self.sigmas[i]), float(self.sigmas[i + 1])
            dt = sigma_next - sigma
            s = NOISE_LEVEL * math.sqrt(sigma / (1 - (float(self.sigmas[1]) if sigma == 1
                                                      else sigma)))
            x, v = sample.float(), model_output.float()
            mean = x + (v + s * s / (2 * sigma) * (x + (1 - sigma) * v)) * dt
            std = s * math.sqrt(-dt)
            nxt = (mean + std * self.noise(x)).to(sample.dtype)
            log_prob = (-((nxt.float() - mean) ** 2) / (2 * std * std) - math.log(std)
                        - 0.5 * math.log(2 * math.pi))
            self.latents.append(nxt)
            self.log_probs.append(log_prob.flatten(1).mean(dim=1))
            self._step_index += 1
            return (nxt,)

    return FlowSDEScheduler.from_config(config)


def diffusers_pipeline(adapters: dict[str, str], threads: int = 0) -> Any:
    import torch
    from diffusers import FluxPipeline

    from diffrt.engine.models.shipped import shipped_folder

    if threads:
        torch.set_num_threads(threads)
    pipe = FluxPipeline.from_pretrained(shipped_folder(MODEL), dtype=torch.float32,
                                        local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = flow_sde_scheduler(pipe.scheduler.config)
    for name, path in adapters.items():
        pipe.load_lora_weights(path, adapter_name=name)
    return pipe


def diffusers_rollout(pipe: Any, prompt: str, adapter: str | None, seeds: list[int],
                      steps: int) -> tuple[list[Any], Any, Any]:
    """One group: (images, log-probs (n, T), latents (n, T + 1, tokens, C) packed)."""
    import torch

    if adapter is None:
        if any(pipe.get_list_adapters().values()):
            pipe.disable_lora()
    else:
        pipe.enable_lora()
        pipe.set_adapters([adapter], [1.0])
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    latent = 2 * (SIZE // (pipe.vae_scale_factor * 2))
    pipe.scheduler.begin(generators, latent, latent)
    images = pipe(prompt, negative_prompt="", true_cfg_scale=CFG, guidance_scale=1.0,
                  height=SIZE, width=SIZE, num_inference_steps=steps,
                  num_images_per_prompt=len(seeds), generator=generators,
                  max_sequence_length=16, output_type="pil").images
    sched = pipe.scheduler
    return images, torch.stack(sched.log_probs, dim=1), torch.stack(sched.latents, dim=1)


def _diffusers_run(spec: dict[str, Any]) -> dict[str, Any]:
    load = groups(spec["prompts"], spec["seeds"])
    pipe = diffusers_pipeline(spec["adapters"], spec.get("threads") or 0)
    for prompt, adapter, seeds in (load[0], load[-1]):
        diffusers_rollout(pipe, prompt, adapter, seeds[:2], 2)
    start = time.perf_counter()
    results = [diffusers_rollout(pipe, prompt, adapter, seeds, spec["steps"])
               for prompt, adapter, seeds in load]
    wall = time.perf_counter() - start
    for (_, log_probs, _), (_, _, seeds) in zip(results, load, strict=True):
        assert log_probs.shape == (len(seeds), spec["steps"])
    return {"wall": wall, "samples": sum(len(s) for _, _, s in load),
            "first_log_probs": results[0][1].tolist()}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    return _diffusers_run(spec) if spec["system"] == "diffusers" else _diffrt_run(spec)


def _child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['system']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the parent ------------------------------------------------------------------------------
def run(args: argparse.Namespace, adapters: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rnd in range(args.rounds):
        order = SYSTEMS[rnd % len(SYSTEMS):] + SYSTEMS[:rnd % len(SYSTEMS)]
        for system in order:
            spec = {"system": system, "prompts": args.prompts, "seeds": args.seeds,
                    "steps": args.steps, "threads": args.torch_threads, "adapters": adapters}
            results[system].append(_child(spec, args.child_timeout))
            r = results[system][-1]
            print(f"  round {rnd + 1}/{args.rounds} {system}: {r['wall']:.1f} s "
                  f"({r['samples'] / r['wall']:.2f} samples/s)", file=sys.stderr, flush=True)
    return results


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    samples = args.prompts * args.seeds
    print(f"\n== rollouts: {args.prompts} prompts x {args.seeds} seeds = {samples} samples with "
          f"log-probs and trajectories, {MODEL} {SIZE}x{SIZE}, {args.steps} steps, true CFG "
          f"{CFG}, flow-sde (noise level {NOISE_LEVEL}), adapters A/B (rank {RANK}) half the "
          f"prompts each, float32; median of {args.rounds} round(s), each system in a fresh "
          f"process" + (f", {args.torch_threads} torch thread(s)" if args.torch_threads else "")
          + " ==\n")
    print("| system | samples/s | wall s (median) | rounds' walls s |")
    print("|---|---:|---:|---|")
    rows: dict[str, dict[str, Any]] = {}
    for system in SYSTEMS:
        walls = [r["wall"] for r in results[system]]
        wall = median(walls)
        rows[system] = {"samples_per_s": samples / wall, "wall_s": wall, "round_walls_s": walls}
        print(f"| {system} | {samples / wall:.2f} | {wall:.2f} | "
              f"{', '.join(f'{w:.1f}' for w in walls)} |")
    ratios = {
        "diffrt / diffusers": rows["diffrt"]["samples_per_s"] / rows["diffusers"]["samples_per_s"],
        "diffrt deterministic / diffrt": (rows["diffrt deterministic"]["samples_per_s"]
                                          / rows["diffrt"]["samples_per_s"]),
        "diffrt deterministic / diffusers": (rows["diffrt deterministic"]["samples_per_s"]
                                             / rows["diffusers"]["samples_per_s"]),
    }
    goals = {"diffrt / diffusers": " (goal >= 1.5)",
             "diffrt deterministic / diffrt": " (the cost of deterministic=True)"}
    print()
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}{goals.get(name, '')}")
    first = {s: results[s][0]["first_log_probs"] for s in SYSTEMS}
    gap = max(abs(a - b) for ra, rb in zip(first["diffrt"], first["diffusers"], strict=True)
              for a, b in zip(ra, rb, strict=True))
    print(f"same samples: the first group's log-probs, diffrt vs diffusers, differ by at most "
          f"{gap:.1e}")
    return {"systems": rows, "ratios": ratios, "first_group_log_prob_gap": gap}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--seeds", type=int, default=8, help="samples per prompt (the group)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help="4 prompts x 2 seeds, 3 steps, 1 round: that it runs, not a figure")
    ap.add_argument("--torch-threads", type=int, default=0, metavar="N",
                    help="torch threads of every system (the engine's torch_threads; default: "
                         "the engine's choice, torch's default for diffusers)")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--child-timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.quick:
        args.prompts, args.seeds, args.steps, args.rounds = 4, 2, 3, 1
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="diffrt-bench-rollouts-") as work:
        adapters = make_adapters(Path(work))
        figures = report(run(args, adapters), args)
    print(f"\n(whole run {time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
