"""``diffrt env --check``: the one prepared check to run on a new accelerator.

Prints one JSON object with eight parts, each measured side by side in this
run and each allowed to fail alone (its entry then holds ``error``):

- ``env``: the platform report (``diffrt env --json``);
- ``d2h``: device-to-host GB/s of one 64 MiB tensor into pageable memory, a
  pinned buffer and a registered shared-memory arena (the output path);
- ``async_vs_sync``: the same requests through an engine with asynchronous
  output and one with synchronous output, on the tiny models: the outputs
  must be bit-identical (an output thread that reads too early is not);
- ``bubble``: requests back to back on a transformer with Flux's real widths
  (``check_runner``), outputs image-sized: requests per second with async
  output, sync output and no output, and the share of the bubble removed;
- ``engine_overhead``: the engine (worker process, scheduler, output path)
  against a bare loop over the same pipeline in this process;
- ``weights`` (``weights_check``): as loaded, ``int8``, ``fp8`` and both
  offloads on tiny-flux, side by side: requests per second, the weights on
  the device, the device's peak memory, PSNR (the offloads: the same bits);
  what the platform refuses is entered with its reason;
- ``host_register_error`` and ``rank_devices`` (``gpu_checks``, NVIDIA only,
  else ``{"skipped": reason}``): a failed host registration leaves no error for
  the next launch; each rank's tensors, streams and events on its own device.

The exit status is 1 when a part failed or outputs differed. On CPU it runs
too (with ``--quick`` in the test suite); its figures mean something on an
accelerator only.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from diffrt.cli.bench_stats import median

if TYPE_CHECKING:
    from diffrt.platforms.interface import Platform

#: no request of the check may take longer (a hang fails its part, not the check)
REQUEST_TIMEOUT_S = 300.0
#: the parts only a lent NVIDIA GPU runs (``gpu_checks``); elsewhere "skipped"
GPU_PARTS = ("host_register_error", "rank_devices")


@dataclass
class CheckOptions:
    size: int = 1024                # bubble part: image side
    widths: str = "flux"            # "flux" (real widths) or "tiny"
    double_blocks: int = 2
    single_blocks: int = 4
    min_forward_s: float = 0.1      # steps per request are calibrated to this
    bubble_requests: int = 8
    bubble_repeats: int = 3
    identical_requests: int = 50
    identical_size: int = 256
    identical_steps: int = 4
    overhead_requests: int = 8
    d2h_mib: int = 64
    weights_requests: int = 4
    weights_size: int = 256
    weights_steps: int = 4
    executor: str = "mp"

    @classmethod
    def quick(cls) -> CheckOptions:
        """Small enough for a CPU (the test of the check itself)."""
        return cls(size=128, widths="tiny", double_blocks=1, single_blocks=1,
                   min_forward_s=0.0, bubble_requests=3, bubble_repeats=1,
                   identical_requests=4, identical_size=64, identical_steps=2,
                   overhead_requests=2, d2h_mib=4, weights_requests=2, weights_size=64,
                   weights_steps=2)


# -- the serving loop the bubble is measured with (benchmarks share it) -------------
def serve_back_to_back(ex: Any, payloads: list[Any], consume: Callable[[Any], None],
                       output_key: Callable[[Any], str]) -> tuple[float, float]:
    """Executes issued back to back (the next as soon as COMPUTE_DONE arrives, as
    the engine does), each output consumed on another thread.

    Returns the steady-state seconds per request — the interval between the
    second and the last request's completion (its output consumed; for a
    request without output, its execute returning) over n - 2, so neither
    the pipeline's fill (the first request waits for everything to start) nor
    its drain (the last copy, which nothing can hide) counts — and the mean
    forward time the runners reported (``reply.forward_s`` or ``reply.seconds``).
    """
    pending: list[Any] = []
    finished: list[float] = []
    failed: list[BaseException] = []
    cond = threading.Condition()
    done = threading.Event()

    def consumer() -> None:
        try:
            while len(finished) < len(payloads):
                with cond:
                    while not pending:
                        cond.wait()
                    oid = pending.pop(0)
                if oid is not None:
                    consume(ex.wait_output_ready(oid).result())
                    finished.append(time.perf_counter())
        except BaseException as exc:  # an output that never came: the caller raises it
            failed.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=consumer, daemon=True)
    forward = 0.0
    start = time.perf_counter()
    thread.start()
    for p in payloads:
        out = ex.execute(p)
        reply = out.reply
        forward += getattr(reply, "forward_s", 0.0) or getattr(reply, "seconds", 0.0)
        oid = out.output_ids.get(output_key(p))
        if oid is None:
            finished.append(time.perf_counter())
        with cond:
            pending.append(oid)
            cond.notify()
    done.wait()
    if failed:
        raise failed[0]
    n = len(payloads)
    if n > 2:
        per_request = (finished[-1] - finished[1]) / (n - 2)
    else:
        per_request = (finished[-1] - start) / n
    return per_request, forward / n


def _median(values: Sequence[float]) -> float:
    """``median`` of a run's samples (every run here has some)."""
    value = median(values)
    assert value is not None
    return value


def bubble_removed(sync_s: float, async_s: float, bound_s: float) -> float | None:
    """(sync - async) / (sync - bound): the share of the output bubble the async
    path removes; None when there is no bubble to remove."""
    bubble = sync_s - bound_s
    return (sync_s - async_s) / bubble if bubble > 0 else None


# -- parts ---------------------------------------------------------------------------------
def d2h_rates(platform: Platform, mib: int, repeats: int = 10) -> dict[str, Any]:
    """GB/s of one device-to-host copy of ``mib`` MiB into each kind of host memory."""
    import torch

    from diffrt.runtime.shm_transport import Arena

    numel = (mib << 20) // 4
    device = platform.torch_device(None if platform.device_type == "cpu" else 0)
    src = torch.randn(numel, device=device)
    events = platform.supports_async_output and platform.device_type != "cpu"
    side = platform.new_side_stream() if events else None

    def copy_into(dst: torch.Tensor) -> None:
        if side is None:
            dst.copy_(src)
            return
        platform.wait_event(side, platform.record_device_event())
        platform.copy_async(dst, src, side)
        platform.wait_copied(platform.record_device_event(side), side)

    def rate(dst: torch.Tensor) -> float:
        copy_into(dst)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            copy_into(dst)
            times.append(time.perf_counter() - start)
        if not torch.equal(dst, src.cpu()):
            raise RuntimeError("the copied bytes differ from the device's")
        return round(numel * 4 / _median(times) / 1e9, 2)

    out: dict[str, Any] = {"mib": mib, "pageable": rate(torch.empty(numel))}
    out["pinned"] = (rate(platform.empty_pinned((numel,), torch.float32))
                     if platform.pinned_memory_available() else None)
    arena = Arena.create(numel * 4)
    try:
        handle = platform.register_host_memory(arena.bytes_view(0, arena.size))
        if handle is None:
            out["registered_arena"] = None
        else:
            try:
                out["registered_arena"] = rate(arena.tensor_view(0, torch.float32, [numel]))
            finally:
                platform.unregister_host_memory(handle)
    finally:
        arena.close()
    return out


def async_vs_sync(opts: CheckOptions) -> dict[str, Any]:
    """The same requests through async- and sync-output engines: bit-identical?"""
    import torch

    from diffrt.engine import DiffusionEngine, EngineConfig
    from diffrt.engine.request import DiffusionRequest
    from diffrt.engine.sampling import SamplingParams

    models = ["tiny-flux", "tiny-sd3"]
    per_model = math.ceil(opts.identical_requests / len(models))
    result: dict[str, Any] = {"requests": 0, "identical": 0, "mismatched_ids": []}
    for model in models:
        engines: list[Any] = []
        try:
            for flag in (True, False):  # inside the try: a failed start closes the first
                engines.append(DiffusionEngine.make_engine(EngineConfig(
                    model=model, async_output=flag, executor_backend=opts.executor)))
            for i in range(per_model):
                params = SamplingParams(height=opts.identical_size, width=opts.identical_size,
                                        num_inference_steps=opts.identical_steps, seed=i,
                                        output_type="pt")
                outs = [engine.generate(DiffusionRequest(prompt=f"check {i}",
                                                         request_id=f"{model}-{i}-{k}",
                                                         sampling_params=params),
                                        timeout=REQUEST_TIMEOUT_S)
                        for k, engine in enumerate(engines)]
                for o in outs:
                    if not o.ok:
                        raise RuntimeError(f"{model} request {i} failed: {o.error}")
                result["requests"] += 1
                if torch.equal(outs[0].output, outs[1].output):
                    result["identical"] += 1
                else:
                    result["mismatched_ids"].append(f"{model}-{i}")
        finally:
            for engine in engines:
                engine.close()
    result["ok"] = result["identical"] == result["requests"]
    return result


def bubble(opts: CheckOptions) -> dict[str, Any]:
    """Async vs sync vs no output on the Flux-width transformer, back to back."""
    from diffrt.cli.check_runner import CHECK_PROTOCOL, Calibrate, CheckSettings, Forward
    from diffrt.runtime import ExecutorConfig, RunnerSpec
    from diffrt.runtime.factory import make_executor

    settings = CheckSettings(size=opts.size, widths=opts.widths,
                             double_blocks=opts.double_blocks, single_blocks=opts.single_blocks)
    spec = RunnerSpec("diffrt.cli.check_runner:FluxWidthRunner", CHECK_PROTOCOL, settings)
    executors: dict[str, Any] = {}
    try:
        for mode in ("async", "sync"):  # inside the try: a failed start shuts the first
            executors[mode] = make_executor(opts.executor, ExecutorConfig(
                runner=spec, async_output=mode == "async"))
        step_s = executors["async"].execute(Calibrate()).reply.seconds
        steps = max(1, math.ceil(opts.min_forward_s / step_s)) if step_s > 0 else 1

        def payloads(drop: bool, base: int) -> list[Forward]:
            return [Forward(id=f"b{base + i}", steps=steps, seed=i, drop=drop)
                    for i in range(opts.bubble_requests)]
        for ex in executors.values():  # warm both paths
            serve_back_to_back(ex, payloads(False, 0)[:2], _release, _forward_id)
        runs: dict[str, list[float]] = {"async": [], "sync": [], "no_output": []}
        for rep in range(opts.bubble_repeats):  # interleaved: drift hits every mode alike
            base = 1000 * (rep + 1)
            runs["no_output"].append(serve_back_to_back(
                executors["async"], payloads(True, base), _release, _forward_id)[0])
            for mode in ("async", "sync"):
                runs[mode].append(serve_back_to_back(
                    executors[mode], payloads(False, base), _release, _forward_id)[0])
        t = {k: _median(v) for k, v in runs.items()}
        forward = step_s * steps
        return {
            "size": opts.size, "widths": opts.widths,
            "blocks": [opts.double_blocks, opts.single_blocks], "steps_per_request": steps,
            "step_ms": round(step_s * 1e3, 2), "forward_ms": round(forward * 1e3, 1),
            "output_mb": round(3 * opts.size * opts.size * 4 / 1e6, 1),
            "requests_per_s": {k: round(1 / v, 3) for k, v in t.items()},
            "ms_per_request": {k: round(v * 1e3, 1) for k, v in t.items()},
            "bubble_removed_vs_no_output": _share(t["sync"], t["async"], t["no_output"]),
            "bubble_removed_vs_forward": _share(t["sync"], t["async"], forward),
        }
    finally:
        for ex in executors.values():
            ex.shutdown()


def engine_overhead(opts: CheckOptions) -> dict[str, Any]:
    """Engine.generate vs a bare pipeline loop in this process, interleaved."""
    import torch

    from diffrt.engine import DiffusionEngine, EngineConfig
    from diffrt.engine.pipelines.interface import DiffusionRequestBatch
    from diffrt.engine.pipelines.load import load_pipeline
    from diffrt.engine.request import DiffusionRequest
    from diffrt.engine.sampling import SamplingParams
    from diffrt.platforms import current_platform as platform

    device = platform.torch_device(None if platform.device_type == "cpu" else 0)
    engine = DiffusionEngine.make_engine(EngineConfig(
        model="tiny-flux", executor_backend=opts.executor, dtype="float32"))
    try:
        pipeline = load_pipeline("tiny-flux", device=device, dtype=torch.float32)

        def request(i: int, who: str) -> DiffusionRequest:
            params = SamplingParams(height=opts.identical_size, width=opts.identical_size,
                                    num_inference_steps=opts.identical_steps, seed=i,
                                    output_type="pt")
            return pipeline.spec.with_defaults(DiffusionRequest(
                prompt="overhead", request_id=f"{who}{i}", sampling_params=params))

        def bare(i: int) -> None:
            [image] = pipeline.forward(DiffusionRequestBatch([request(i, "bare")]))
            assert isinstance(image, torch.Tensor)  # no rollout asked: the images alone
            image.cpu()

        def via_engine(i: int) -> None:
            out = engine.generate(request(i, "engine"), timeout=REQUEST_TIMEOUT_S)
            if not out.ok:
                raise RuntimeError(out.error)

        bare(0)
        via_engine(0)
        times: dict[str, list[float]] = {"engine": [], "bare": []}
        for i in range(1, opts.overhead_requests + 1):
            for name, fn in (("engine", via_engine), ("bare", bare)):
                start = time.perf_counter()
                fn(i)
                times[name].append(time.perf_counter() - start)
        t = {k: _median(v) for k, v in times.items()}
        return {"model": "tiny-flux", "size": opts.identical_size,
                "steps": opts.identical_steps,
                "ms_per_request": {k: round(v * 1e3, 2) for k, v in t.items()},
                "overhead_ms": round((t["engine"] - t["bare"]) * 1e3, 2),
                "engine_over_bare": round(t["engine"] / t["bare"], 3)}
    finally:
        engine.close()


def _share(sync_s: float, async_s: float, bound_s: float) -> float | None:
    share = bubble_removed(sync_s, async_s, bound_s)
    return None if share is None else round(share, 3)


def _release(lease: Any) -> None:
    lease.release()


def _forward_id(p: Any) -> str:
    return p.id


def run_check(opts: CheckOptions) -> tuple[dict[str, Any], bool]:
    """All parts in order; returns (the JSON object, whether everything passed)."""
    from diffrt.cli import gpu_checks, weights_check
    from diffrt.engine import cost_store
    from diffrt.platforms import current_platform as platform
    from diffrt.platforms.report import platform_report

    started = time.perf_counter()
    result: dict[str, Any] = {"options": asdict(opts)}
    ok = True
    parts: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("env", platform_report),
        ("d2h", lambda: d2h_rates(platform, opts.d2h_mib)),
        ("async_vs_sync", lambda: async_vs_sync(opts)),
        ("bubble", lambda: bubble(opts)),
        ("engine_overhead", lambda: engine_overhead(opts)),
        ("weights", lambda: weights_check.weights_part(
            requests=opts.weights_requests, size=opts.weights_size, steps=opts.weights_steps,
            timeout_s=REQUEST_TIMEOUT_S)),
        ("host_register_error", lambda: gpu_checks.host_register_error(platform)),
        ("rank_devices", lambda: gpu_checks.rank_devices(platform)),
        # after engine_overhead and weights: their engines persisted what they measured
        ("step_cost", lambda: {"models": cost_store.persisted()}),
    ]
    for name, part in parts:
        t0 = time.perf_counter()
        try:
            result[name] = part()
        except Exception as exc:  # one failed part must not lose the others' figures
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
            ok = False
        result[name]["seconds"] = round(time.perf_counter() - t0, 1)
    ok = ok and bool(result["async_vs_sync"].get("ok")) and result["weights"].get("ok", True)
    ok = ok and all(result[part].get("ok", True) for part in GPU_PARTS)
    result["ok"] = ok
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result, ok
