"""Async two-phase output vs synchronous output vs no output, and transport speed.

Printed, never asserted. Run from the repository root:

    .venv/bin/python benchmarks/bench_async_output.py            # tiny-flux 512 + 1024, synthetic, transport
    .venv/bin/python benchmarks/bench_async_output.py --sizes 512 --requests 4 --skip-transport
    .venv/bin/python benchmarks/bench_async_output.py --skip-transport --skip-synthetic \
        --sizes 1024 --identical 50          # on a GPU: throughput + bit-identical outputs

Part 1 serves the embedded model ``tiny-flux`` through the
multiprocess executor like the engine does (the loop issues the next execute
as soon as COMPUTE_DONE arrives; a consumer thread waits for each output and
copies it out). Three modes in one run: async output, synchronous output, and
the output step removed (the limit). The bubble share removed is
(sync - async) / (sync - limit) in time per request.

Part 2 repeats this with a synthetic forward of fixed cost and a large output,
so the size of the bubble, not the model, sets the figure. It runs on the
simulated asynchronous device of the test plugin (``diffrt-simdevice``) when
it is installed, where forward is a kernel on the compute stream (the host
only launches it, as on a GPU) and a device-to-host copy takes
``--sim-copy-gbps`` plus a real memcpy; a copy into pageable memory blocks its
issuing thread as on CUDA. It is measured once per host path the output writer
can take: the arena page-locked in place, pinned staging buffers (XPU's path),
and plain pageable memory. ``--synthetic-device current`` runs it on whatever
platform this machine has instead (a busy-loop forward on CPU).

Part 3 compares moving one tensor to another process's view: the shared-memory
transport (one copy into a warm arena slot, read in place), a plain memcpy of
the same bytes, and pickling the tensor through a pipe.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from diffrt.cli.bench_stats import median
from diffrt.cli.device_check import bubble_removed, serve_back_to_back
from diffrt.runtime import ExecutorConfig, RunnerProtocol, RunnerResult, RunnerSpec
from diffrt.runtime.factory import make_executor

HERE = Path(__file__).resolve().parent


class BenchSettings(msgspec.Struct):
    model: str | None = None


class RunModel(msgspec.Struct, tag="run_model"):
    """One request through the model's request-level forward."""

    id: str
    size: int
    steps: int
    seed: int
    output: str
    drop: bool


class Blob(msgspec.Struct, tag="blob"):
    """The same ready tensor every time: measures the output path alone."""

    numel: int


class Synthetic(msgspec.Struct, tag="synthetic"):
    """A forward of fixed cost and an output of a given size."""

    id: str
    forward_ms: float
    numel: int
    seed: int
    drop: bool


class Forwarded(msgspec.Struct, tag="forwarded"):
    bytes: int = 0
    forward_s: float = 0.0


BENCH_PROTOCOL = RunnerProtocol(settings=BenchSettings, requests=RunModel | Blob | Synthetic,
                                replies=Forwarded)


class BenchRunner:
    """Lives in the worker: tiny-flux forward, or a synthetic forward."""

    protocol = BENCH_PROTOCOL

    def __init__(self, settings: BenchSettings, *, rank: int, world_size: int, platform: Any):
        self.platform = platform
        self.device = platform.torch_device(None if platform.device_type == "cpu" else rank)
        self.pipeline = None
        if settings.model:
            from diffrt.engine.pipelines.load import load_pipeline

            self.pipeline = load_pipeline(settings.model, device=self.device)
        self._a = torch.randn(512, 512, device=self.device)
        self._blob: torch.Tensor | None = None

    def close(self) -> None:
        self._blob = None

    def handle(self, request: Any) -> RunnerResult:
        match request:
            case RunModel():
                return self.model(request)
            case Blob():
                return self.blob(request)
            case Synthetic():
                return self.synthetic(request)
            case _:
                raise TypeError(f"BenchRunner cannot handle {type(request).__name__}")

    def model(self, p: RunModel) -> RunnerResult:
        from diffrt.engine.pipelines.interface import DiffusionRequestBatch
        from diffrt.engine.request import DiffusionRequest
        from diffrt.engine.sampling import SamplingParams

        req = DiffusionRequest(prompt="a red fox", request_id=p.id, sampling_params=SamplingParams(
            height=p.size, width=p.size, num_inference_steps=p.steps, seed=p.seed))
        start = time.perf_counter()
        [image] = self.pipeline.forward(DiffusionRequestBatch([req]))
        if p.output == "uint8":
            image = self.pipeline.to_transfer(image, req.sampling_params)
        return RunnerResult(reply=Forwarded(bytes=image.numel() * image.element_size(),
                                            forward_s=time.perf_counter() - start),
                            outputs={} if p.drop else {p.id: image})

    def blob(self, p: Blob) -> RunnerResult:
        if self._blob is None or self._blob.numel() != p.numel:
            self._blob = torch.randn(p.numel, device=self.device)
        return RunnerResult(reply=Forwarded(), outputs={"x": self._blob})

    def synthetic(self, p: Synthetic) -> RunnerResult:
        start = time.perf_counter()
        launch = getattr(self.platform, "launch", None)
        if launch is not None:
            # The simulated device: a kernel that runs for forward_ms and costs the
            # host nothing, as on a GPU; its output was written once (a fill per
            # request would be host CPU that a real device does not spend).
            if self._blob is None or self._blob.numel() != p.numel:
                self._blob = torch.full((p.numel,), float(p.seed))
            launch(lambda: None, delay_s=p.forward_ms / 1000)
            if p.drop:  # no output to wait for: the device's time still counts
                self.platform.synchronize()
            return RunnerResult(reply=Forwarded(forward_s=p.forward_ms / 1000),
                                outputs={} if p.drop else {p.id: self._blob})
        out = torch.empty(p.numel, dtype=torch.float32, device=self.device)
        deadline = start + p.forward_ms / 1000
        x = self._a
        while time.perf_counter() < deadline:
            x = torch.tanh(x @ self._a)
        out.fill_(float(p.seed))
        return RunnerResult(reply=Forwarded(forward_s=time.perf_counter() - start),
                            outputs={} if p.drop else {p.id: out})


#: how the consumer thread reads each output: "copy" takes an owned copy (what
#: a caller keeping the tensor does), "view" reads it in place and releases it
#: (what the engine's uint8 images cost; the measure of the output path alone)
CONSUMER = {"mode": "copy"}


def _consume(lease: Any) -> None:
    if CONSUMER["mode"] == "copy":
        lease.take()
    else:
        lease.release()


def _serve(ex, payloads: list[Any]) -> tuple[float, float]:
    """Steady-state seconds per request and mean forward seconds (see
    ``serve_back_to_back``, which ``diffrt env --check`` measures with too)."""
    return serve_back_to_back(ex, payloads, _consume, lambda p: p.id)


def _executor(async_output: bool, model: str | None, env: dict[str, str] | None = None) -> Any:
    env = {**(env or {}),
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    runner = RunnerSpec("bench_async_output:BenchRunner", BENCH_PROTOCOL, BenchSettings(model))
    return make_executor("mp", ExecutorConfig(
        runner=runner, async_output=async_output, worker_env=env,
        max_pending_output_bytes=1 << 30))


def _report(label: str, runs: dict[str, list[tuple[float, float]]], nbytes: int) -> None:
    """The bubble share the async path removes, two ways: against the no-output
    run, (sync - async) / (sync - limit), and against the forward alone,
    (sync - async) / (sync - forward) — the no-output run synchronises after
    every request, so on an asynchronous device it is not quite the bound and
    the first share can pass 100 %. Overheads are time per request beyond the
    runner's forward time (robust to a noisy machine)."""
    t = {k: median([w for w, _ in v]) for k, v in runs.items()}
    o = {k: median([w - f for w, f in v]) for k, v in runs.items()}
    fwd = median([f for v in runs.values() for _, f in v])

    def share(bound: float) -> float:
        removed = bubble_removed(o["sync"], o["async"], bound)
        return float("nan") if removed is None else removed

    print(f"{label:<24} {1 / t['async']:6.2f} {1 / t['sync']:6.2f} {1 / t['limit']:6.2f} req/s"
          f" | fwd {fwd * 1e3:7.1f} ms  out {nbytes / 1e6:5.1f} MB"
          f" | overhead ms/req async {o['async'] * 1e3:5.1f} sync {o['sync'] * 1e3:5.1f}"
          f" limit {o['limit'] * 1e3:5.1f}"
          f" | removed: vs no-output {share(o['limit']) * 100:5.1f} %"
          f"  vs forward {share(0.0) * 100:5.1f} %")


def bench_serving(args: argparse.Namespace) -> None:
    print("\n== requests/s: async | sync | no output (limit); bubble = sync - limit ==")
    print("   overhead = time per request - the runner's forward time")
    ex_async = _executor(True, args.model)
    ex_sync = _executor(False, args.model)
    try:
        for size in args.sizes:
            def payloads(drop: bool, base: int, size: int = size) -> list[RunModel]:
                return [RunModel(id=f"r{base + i}", size=size, steps=args.steps, seed=i,
                                 output=args.output, drop=drop) for i in range(args.requests)]
            warm = payloads(False, 0)[:1]
            _serve(ex_async, warm)
            _serve(ex_sync, warm)
            nbytes = ex_async.execute(msgspec.structs.replace(warm[0], drop=True)).reply.bytes
            times = {k: [] for k in ("async", "sync", "limit")}
            for rep in range(args.repeats):  # interleaved so drift hits all modes alike
                times["limit"].append(_serve(ex_async, payloads(True, 1000 * rep)))
                times["async"].append(_serve(ex_async, payloads(False, 1000 * rep)))
                times["sync"].append(_serve(ex_sync, payloads(False, 1000 * rep)))
            _report(f"{args.model} {size}x{size} {args.steps} st", times, nbytes)
    finally:
        ex_async.shutdown()
        ex_sync.shutdown()


#: the simulated device's abilities per host path (the plugin's switches)
SIM_HOST_PATHS = {
    "page-locked": {},
    "staged": {"DIFFRT_SIMDEVICE_HOST_REGISTER": "0"},
    "pageable": {"DIFFRT_SIMDEVICE_HOST_REGISTER": "0", "DIFFRT_SIMDEVICE_PINNED": "0"},
}


def _synthetic_devices(args: argparse.Namespace) -> list[tuple[str, dict[str, str]]]:
    """(label, worker environment) of every device/host path part 2 measures."""
    if args.synthetic_device == "current":
        return [("current platform", {})]
    try:
        import diffrt_simdevice  # noqa: F401
    except ImportError:
        if args.synthetic_device == "simdevice":
            raise SystemExit("--synthetic-device simdevice needs the diffrt-simdevice test "
                             "plugin (pip install ./tests/plugins/diffrt_simdevice)") from None
        print("(diffrt-simdevice is not installed: part 2 runs on the current platform)")
        return [("current platform", {})]
    # OMP_NUM_THREADS=1: the simulated copy stands for a DMA engine, so its real
    # memcpy must not occupy (and spin-wait on) every host core
    base = {"DIFFRT_PLATFORM": "simdevice", "OMP_NUM_THREADS": "1",
            "DIFFRT_SIMDEVICE_COPY_DELAY_MS": str(args.sim_copy_latency_ms),
            "DIFFRT_SIMDEVICE_COPY_GBPS": str(args.sim_copy_gbps)}
    return [(f"sim {path}", {**base, **extra}) for path, extra in SIM_HOST_PATHS.items()
            if path in args.host_paths]


def bench_synthetic(args: argparse.Namespace) -> None:
    print(f"\n== synthetic forward {args.forward_ms} ms, float32 output ==")
    if args.synthetic_device != "current":
        print(f"   simulated device: copies take {args.sim_copy_latency_ms} ms + bytes at "
              f"{args.sim_copy_gbps} GB/s + a real memcpy")
    for label, env in _synthetic_devices(args):
        ex_async = _executor(True, None, env)
        ex_sync = _executor(False, None, env)
        try:
            for mb in args.synthetic_mb:
                numel = int(mb * 1e6) // 4

                def payloads(drop: bool, numel: int = numel) -> list[Synthetic]:
                    return [Synthetic(id=f"s{i}", forward_ms=args.forward_ms, numel=numel,
                                      seed=i, drop=drop) for i in range(args.synthetic_requests)]
                _serve(ex_async, payloads(False)[:2])
                _serve(ex_sync, payloads(False)[:2])
                times = {k: [] for k in ("async", "sync", "limit")}
                for _ in range(args.repeats):  # interleaved so drift hits all modes alike
                    times["limit"].append(_serve(ex_async, payloads(True)))
                    times["async"].append(_serve(ex_async, payloads(False)))
                    times["sync"].append(_serve(ex_sync, payloads(False)))
                _report(f"{label} {mb:g} MB", times, numel * 4)
        finally:
            ex_async.shutdown()
            ex_sync.shutdown()


def _best(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _transport_row(mb: float, repeats: int) -> list[float]:
    from diffrt.runtime.shm_transport import Arena, PackPlan, SlotAllocator, read_views

    src = torch.randn(int(mb * 1e6) // 4)
    nbytes = src.numel() * 4
    arena = Arena.create(nbytes + (1 << 20))
    plan = PackPlan(src)
    off, gen = SlotAllocator(arena.size).try_allocate(plan.slot_bytes)
    key = plan.key_output("x", off, gen)
    dst = torch.empty_like(src)

    def shm() -> None:  # the worker's one copy into a warm slot + the reader's in-place view
        plan.copy_into(arena, off, lambda d, s: d.copy_(s))
        read_views(arena, key)

    def memcpy() -> None:
        dst.copy_(src)

    def pickled() -> None:
        r, w = os.pipe()
        got: list[Any] = []

        def reader() -> None:
            chunks = []
            with os.fdopen(r, "rb") as f:
                while chunk := f.read(1 << 20):
                    chunks.append(chunk)
            got.append(pickle.loads(b"".join(chunks)))

        th = threading.Thread(target=reader)
        th.start()
        with os.fdopen(w, "wb") as f:
            f.write(pickle.dumps(src, protocol=pickle.HIGHEST_PROTOCOL))
        th.join()

    def fresh() -> None:  # what the runtime avoids: a new segment per output
        a = Arena.create(nbytes)
        a.tensor_view(0, torch.float32, [src.numel()]).copy_(src)
        a.close()

    rates = [nbytes / _best(f, repeats) / 1e9 for f in (shm, memcpy, pickled, fresh)]
    arena.close()
    return rates


def bench_transport(args: argparse.Namespace) -> None:
    print("\n== transport of one tensor (GB/s, best of runs) ==")
    print("shm: one copy into a warm arena slot + in-place view; mp: worker -> engine through")
    print("the multiprocess executor (execute + OUTPUT_READY + view + release, rpc included)")
    print(f"(in-process columns with torch.set_num_threads({args.transport_threads}): a 2-thread")
    print(" copy stalls whenever the machine's other core is busy)")
    print(f"{'size':>8} {'shm':>8} {'mp e2e':>8} {'memcpy':>8} {'pickle+pipe':>12} {'fresh segment':>14}")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.transport_threads)
    ex = _executor(True, None)
    try:
        for mb in args.transport_mb:
            shm, memcpy, pickled, fresh = _transport_row(mb, args.transport_repeats)
            numel = int(mb * 1e6) // 4

            def e2e(numel: int = numel) -> None:
                out = ex.execute(Blob(numel))
                ex.wait_output_ready(out.output_ids["x"]).result().release()

            mp = numel * 4 / _best(e2e, args.transport_repeats) / 1e9
            print(f"{mb:>6g}MB {shm:>8.2f} {mp:>8.2f} {memcpy:>8.2f} {pickled:>12.2f} {fresh:>14.2f}")
    finally:
        ex.shutdown()
        torch.set_num_threads(threads)


def check_identical(args: argparse.Namespace) -> None:
    """Async and sync outputs must be bit-identical request by request: on a real
    device, what tests/runtime/test_output_thread_simdevice.py checks on the
    simulated one (an output thread that reads before the copy completed
    delivers wrong bytes)."""
    print(f"\n== async vs sync outputs, {args.identical} requests at {args.identical_size}^2 ==")
    ex_async = _executor(True, args.model)
    ex_sync = _executor(False, args.model)
    try:
        mismatches = 0
        for i in range(args.identical):
            p = RunModel(id=f"c{i}", size=args.identical_size, steps=args.steps, seed=i,
                         output=args.output, drop=False)
            got = []
            for ex in (ex_async, ex_sync):
                out = ex.execute(p)
                got.append(ex.wait_output_ready(out.output_ids[p.id]).result().take())
            mismatches += not torch.equal(got[0], got[1])
        print(f"bit-identical: {args.identical - mismatches}/{args.identical}")
    finally:
        ex_async.shutdown()
        ex_sync.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-flux")
    ap.add_argument("--sizes", type=int, nargs="*", default=[512, 1024])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--requests", type=int, default=3, help="back-to-back requests per measurement")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--output", choices=["float32", "uint8"], default="float32",
                    help="float32 decoded images (output_type pt) or the engine's uint8 transfer form")
    ap.add_argument("--forward-ms", type=float, default=100.0)
    ap.add_argument("--synthetic-mb", type=float, nargs="*", default=[12.6, 100.0])
    ap.add_argument("--synthetic-requests", type=int, default=8)
    ap.add_argument("--synthetic-device", choices=["auto", "simdevice", "current"],
                    default="auto", help="part 2 on the simulated device (auto: when installed)")
    ap.add_argument("--host-paths", nargs="*", default=list(SIM_HOST_PATHS),
                    choices=list(SIM_HOST_PATHS), help="simulated device: host paths to measure")
    ap.add_argument("--sim-copy-gbps", type=float, default=4.0)
    ap.add_argument("--sim-copy-latency-ms", type=float, default=0.1)
    ap.add_argument("--transport-mb", type=float, nargs="*", default=[3.1, 12.6, 100.0])
    ap.add_argument("--transport-repeats", type=int, default=10)
    ap.add_argument("--transport-threads", type=int, default=1)
    ap.add_argument("--identical", type=int, default=0,
                    help="also check async == sync outputs over this many requests (e.g. 50)")
    ap.add_argument("--identical-size", type=int, default=256)
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--skip-synthetic", action="store_true")
    ap.add_argument("--skip-transport", action="store_true")
    ap.add_argument("--consumer", choices=["copy", "view"], default="copy",
                    help="read outputs as owned copies or in place (parts 1 and 2)")
    args = ap.parse_args(argv)
    CONSUMER["mode"] = args.consumer
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    if not args.skip_transport:
        bench_transport(args)
    if not args.skip_synthetic:
        bench_synthetic(args)
    if not args.skip_model and args.sizes:
        bench_serving(args)
    if args.identical:
        check_identical(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
