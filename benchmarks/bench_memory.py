"""Lower-precision weights and layer-wise offload (issue 34): memory, speed and
quality per method, and the copy time offload hides.

One run on CPU, nothing asserted, medians printed with ratios:

1. **per method** (``quantization`` none / fp8-storage / int8; fp8 only where
   the device has float8 matmuls, so not here; gguf: the model's folder with
   its transformer written as a Q8_0 GGUF file, ``gguf_file.gguf_folder``), each in a fresh process so
   its peak memory is its own, the methods' processes interleaved over
   ``--rounds`` rounds (the order rotating): the transformer's resident
   weight bytes (``DiffusionEngine.weight_bytes``, counted from the
   storages), the worker's peak RSS (``ru_maxrss``: the in-process executor,
   so the engine process is the worker), throughput over ``--requests``
   tiny-flux requests against unquantised (no speed goal on CPU: int8
   dequantises per call), PSNR of each image against the unquantised one of
   the same seed, and diffrt-shapes' classifier on the 30 held-out prompts
   (seeds 0..29, 12 steps: the model card's evaluation), counts out of 30.
2. **layer-wise offload on the simulated device** (``diffrt_simdevice``:
   host-to-device copies out of page-locked memory land on a stream thread,
   the compute is the host thread): ``DIFFRT_SIMDEVICE_COPY_DELAY_MS=0`` and
   a ``COPY_GBPS`` chosen so one block's copy takes about half its compute
   (measured first). The tiny-flux pipeline's forward at 256x256 (1024 image
   tokens) without offload (``plain``) and with ``offload_prefetch=1``
   (``overlapped``), interleaved, each timed over its blocks (first block's
   start to last block's end, summed over the steps: the text encoders and
   the VAE around them are the same in both and only add noise), and
   ``serial``: the same offload on a platform that waits for each copy as
   soon as it is issued (nothing hidden); the copy time is serial - plain,
   hidden = (serial - overlapped) / (serial - plain). Goal ≥ 80 %.

Run from the repository root:

    .venv/bin/python benchmarks/bench_memory.py            # about 3 minutes on 2 cores
    .venv/bin/python benchmarks/bench_memory.py --quick    # one round, fewer requests
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import statistics
import time

import numpy as np

#: quantization values, and "gguf": the model's transformer as a Q8_0 GGUF file
METHODS = ("none", "fp8-storage", "int8", "gguf")
HIDDEN_GOAL = 0.80


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255 ** 2 / mse)


# -- 1. one method, in a process of its own ----------------------------------------------
def run_method(method: str, requests: int, threads: int) -> dict:
    import resource

    import torch

    torch.set_num_threads(threads)
    import tempfile

    import msgspec

    from diffrt.demo import shapes
    from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams
    from diffrt.engine.models.gguf_file import gguf_folder
    from diffrt.engine.models.registry import resolve_model_spec

    folders = tempfile.TemporaryDirectory()

    def engine(model: str) -> DiffusionEngine:
        if method == "gguf":  # the model's folder with its transformer as a Q8_0 file
            folder = gguf_folder(resolve_model_spec(model).folder, f"{folders.name}/{model}")
            return DiffusionEngine.make_engine(EngineConfig(
                model=folder, executor_backend="inproc", torch_threads=threads))
        return DiffusionEngine.make_engine(EngineConfig(
            model=model, executor_backend="inproc", quantization=method, torch_threads=threads))

    def request(model: str, prompt: str, **given) -> DiffusionRequest:
        """The named model's defaults spelled out — sampling and negative
        prompt (a folder by path has its family's) — so every method draws
        the same request."""
        spec = resolve_model_spec(model)
        defaults = msgspec.structs.asdict(spec.defaults)
        defaults.pop("strength")  # image-to-image only
        return DiffusionRequest(prompt, negative_prompt=spec.default_negative_prompt,
                                sampling_params=SamplingParams(**{**defaults, **given}))

    result: dict = {"method": method}
    with engine("tiny-flux") as e:
        assert e.weight_bytes is not None
        result["transformer_bytes"] = sum(e.weight_bytes.components["transformer"].values())
        result["all_bytes"] = sum(sum(h.values()) for h in e.weight_bytes.components.values())
        images, start = [], time.perf_counter()
        for seed in range(requests):
            out = e.generate(request("tiny-flux", "a red square on a blue field", seed=seed,
                                     num_inference_steps=8))
            images.append(np.asarray(out.images[0]))
        result["rps"] = requests / (time.perf_counter() - start)
        result["images"] = [im.tolist() for im in images]
    scenes = shapes.HELD_OUT[:30]
    with engine("diffrt-shapes") as e:
        drawn = [e.generate(request("diffrt-shapes", s.prompt, seed=i)).images[0]
                 for i, s in enumerate(scenes)]
    folders.cleanup()
    result["shapes"] = shapes.tally(scenes, drawn)
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def methods_section(rounds: int, requests: int, threads: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    for r in range(rounds):
        order = METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]
        for method in order:
            with ctx.Pool(1) as pool:
                runs[method].append(pool.apply(run_method, (method, requests, threads)))
            print(f"  round {r + 1}/{rounds}: {method} done", flush=True)
    base_images = [np.asarray(im, np.uint8) for im in runs["none"][0]["images"]]
    base_rps = statistics.median(run["rps"] for run in runs["none"])
    rows = []
    for method in METHODS:
        first = runs[method][0]
        images = [np.asarray(im, np.uint8) for im in first["images"]]
        values = [psnr(a, b) for a, b in zip(images, base_images, strict=True)]
        rows.append({
            "method": method,
            "transformer_bytes": first["transformer_bytes"], "all_bytes": first["all_bytes"],
            "peak_rss": statistics.median(run["peak_rss"] for run in runs[method]),
            "rps": statistics.median(run["rps"] for run in runs[method]),
            "x_rps": statistics.median(run["rps"] for run in runs[method]) / base_rps,
            "psnr_min": min(values), "psnr_median": statistics.median(values),
            "shapes": first["shapes"]})
    return rows


# -- 2. offload on the simulated device ---------------------------------------------------
def offload_section(rounds: int, threads: int) -> dict:
    import torch
    from diffrt_simdevice.platform import SimDevicePlatform

    torch.set_num_threads(threads)
    from diffrt.engine.models.registry import resolve_model_spec
    from diffrt.engine.pipelines import DiffusionRequestBatch, load_pipeline
    from diffrt.engine.request import DiffusionRequest
    from diffrt.engine.sampling import SamplingParams
    from diffrt.engine.weights.offload import transformer_blocks

    cpu = torch.device("cpu")
    spec = resolve_model_spec("tiny-flux")
    request = DiffusionRequest("a red square", sampling_params=SamplingParams(
        seed=0, num_inference_steps=4, height=256, width=256))
    batch = DiffusionRequestBatch([request])

    plain = load_pipeline(spec, device=cpu, dtype=torch.float32)
    blocks = transformer_blocks(plain.transformer)
    block_s: list[float] = []  # each block's forward, timed by hooks on the plain model

    def start(module, args):
        module._t0 = time.perf_counter()

    def stop(module, args, output):
        block_s.append(time.perf_counter() - module._t0)
    hooks = [h for b in blocks for h in (b.register_forward_pre_hook(start),
                                         b.register_forward_hook(stop))]
    plain.forward(batch)
    block_s.clear()
    plain.forward(batch)
    for h in hooks:
        h.remove()
    compute = statistics.median(block_s)
    block_bytes = statistics.median(
        sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks)
    gbps = block_bytes / (0.5 * compute) / 1e9  # a copy of about half a block's compute

    class SerialCopies(SimDevicePlatform):
        """The same copies, each waited for as soon as it is issued: the
        offload with nothing hidden."""

        def copy_async(self, dst, src, stream=None):
            super().copy_async(dst, src, stream)
            self._stream(stream).synchronize()

    platform = SimDevicePlatform(copy_delay_s=0.0, copy_gbps=gbps)
    offloaded = load_pipeline(spec, device=cpu, dtype=torch.float32)
    offload = offloaded.enable_layerwise_offload(platform, prefetch=1)
    serial_platform = SerialCopies(copy_delay_s=0.0, copy_gbps=gbps)
    serial = load_pipeline(spec, device=cpu, dtype=torch.float32)
    serial.enable_layerwise_offload(serial_platform, prefetch=1)
    copy_each = []
    for block in offload.blocks:  # each block's copy alone, on the same platform
        stream = platform.new_side_stream()
        t0 = time.perf_counter()
        platform.copy_async(offload.slots[0][:block.nbytes], block.host[:block.nbytes], stream)
        platform.event_synchronize(platform.record_device_event(stream))
        copy_each.append(time.perf_counter() - t0)
    calls = len(blocks) * request.sampling_params.num_inference_steps  # block runs a forward
    copy_total = sum(copy_each) * request.sampling_params.num_inference_steps
    # the time from the first block's start (before the offload's own wait:
    # prepended) to the last block's end, summed over a forward's steps: the
    # span the copies share, without the text encoders and the VAE around it
    spans: list[float] = []

    def first(module, args):
        module._t0 = time.perf_counter()

    for pipeline in (plain, offloaded, serial):
        region = transformer_blocks(pipeline.transformer)
        region[0].register_forward_pre_hook(first, prepend=True)
        region[-1].register_forward_hook(lambda m, a, o, region=region: spans.append(
            time.perf_counter() - region[0]._t0))
    offloaded.forward(batch)  # warm
    serial.forward(batch)
    pipelines = {"plain": plain, "overlapped": offloaded, "serial": serial}
    timings: dict[str, list[float]] = {name: [] for name in pipelines}
    order = list(pipelines)
    for r in range(rounds * 4):
        for name in order[r % 3:] + order[:r % 3]:  # the order rotating
            platform.synchronize()
            serial_platform.synchronize()
            spans.clear()
            pipelines[name].forward(batch)
            timings[name].append(sum(spans))
    plain_s = statistics.median(timings["plain"])
    overlapped_s = statistics.median(timings["overlapped"])
    serial_s = statistics.median(timings["serial"])
    copy_s = serial_s - plain_s  # what the copies add when none is hidden, measured
    return {"block_compute_ms": compute * 1e3, "block_copy_ms": statistics.median(copy_each) * 1e3,
            "gbps": gbps, "block_runs": calls, "plain_s": plain_s,
            "overlapped_s": overlapped_s, "serial_s": serial_s, "copy_s": copy_s,
            "copy_alone_s": copy_total,
            "hidden": (serial_s - overlapped_s) / copy_s,
            "device_bytes": offload.device_bytes,
            "host_bytes": offload.host_bytes}


def print_methods(args: argparse.Namespace) -> list[dict]:
    print("1. weight methods (tiny-flux: 8 steps, 64x64; diffrt-shapes: 30 held-out prompts)")
    rows = methods_section(args.rounds, args.requests, args.torch_threads)
    print(f"\n {'method':<12} {'transformer':>11} {'x none':>7} {'all weights':>11} "
          f"{'peak RSS':>9} {'req/s':>6} {'x none':>7} {'PSNR min':>8} {'median':>7}  shapes /30")
    base = rows[0]
    for row in rows:
        hits = row["shapes"]
        print(f" {row['method']:<12} {row['transformer_bytes'] / 2**20:>8.2f} MiB "
              f"{row['transformer_bytes'] / base['transformer_bytes']:>6.3f}x "
              f"{row['all_bytes'] / 2**20:>8.2f} MiB {row['peak_rss'] / 2**20:>6.0f} MiB "
              f"{row['rps']:>6.2f} {row['x_rps']:>6.2f}x {row['psnr_min']:>8.1f} "
              f"{row['psnr_median']:>7.1f}  " + " ".join(f"{k} {v}" for k, v in hits.items()))
    print("   fp8: not run (float8 matmuls need CUDA 8.9+ or ROCm MI300+; refused on CPU)")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--offload-only", action="store_true",
                    help="section 2 only (the simulated device's offload)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.requests = 1, 4
    began = time.perf_counter()
    rows = [] if args.offload_only else print_methods(args)
    print("\n2. layer-wise offload on the simulated device (tiny-flux, 256x256, 4 steps, "
          "prefetch 1)")
    off = offload_section(args.rounds, args.torch_threads)
    print(f"   a block: compute {off['block_compute_ms']:.2f} ms, copy {off['block_copy_ms']:.2f} "
          f"ms ({off['gbps']:.3f} GB/s simulated); device {off['device_bytes'] / 2**20:.2f} MiB "
          f"of blocks' {off['host_bytes'] / 2**20:.2f} MiB")
    print(f"   blocks per forward: plain {off['plain_s'] * 1e3:.0f} ms, overlapped {off['overlapped_s'] * 1e3:.0f} ms, "
          f"serial {off['serial_s'] * 1e3:.0f} ms (copies add {off['copy_s'] * 1e3:.0f} ms "
          f"unhidden; {off['copy_alone_s'] * 1e3:.0f} ms timed alone)")
    met = "met" if off["hidden"] >= HIDDEN_GOAL else "NOT MET"
    print(f"   copy time hidden: {off['hidden'] * 100:.0f} % ({met}: goal >= "
          f"{HIDDEN_GOAL * 100:.0f} %)")
    print(f"\n(whole run {time.perf_counter() - began:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"methods": rows, "offload": off}, f, indent=1)


if __name__ == "__main__":
    main()
