"""Two parts of ``diffrt env --check`` that only a lent NVIDIA GPU can answer
(issue 28; the fakes in tests/platforms cover the same behaviour on CPU):

- ``host_register_error``: a ``cudaHostRegister`` that fails (the range is
  already registered) followed by a kernel launch on the same thread must not
  raise. torch's binding returns the error without clearing the runtime's
  per-thread last error, so diffrt registers on a short-lived thread; the
  part also reports whether the raw binding, called on a throwaway thread,
  leaves the error behind (what the fix protects against).
- ``rank_devices``: each rank, in a process of its own as a worker is, selects
  its device (``rank_device``): its tensors, current stream, a side stream made
  on another thread and the events recorded on them must all be on that device,
  and a side-stream computation after a cross-stream wait must be right.

Elsewhere each part returns ``{"skipped": reason}``, which passes the check.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diffrt.platforms.interface import Platform

#: seconds one rank's child process may take (imports torch, initialises CUDA)
RANK_TIMEOUT_S = 60.0


def skip_reason(platform: Platform) -> str | None:
    """Why the GPU parts cannot run here, or None."""
    if platform.name != "cuda":
        return f"needs an NVIDIA GPU (platform {platform.name})"
    try:
        if platform.device_count() < 1:
            return "needs an NVIDIA GPU (none visible)"
    except Exception as exc:
        return f"needs an NVIDIA GPU ({type(exc).__name__}: {exc})"
    return None


def _launch(device: Any) -> None:
    """A small kernel launch and a synchronise on the calling thread."""
    import torch

    x = torch.arange(1024, device=device, dtype=torch.float32)
    assert float((x * 2).sum().item()) == 1023 * 1024.0
    torch.cuda.synchronize(device)


def _raw_binding_leaves_error(device: Any) -> bool | str:
    """Whether torch's own cudaHostRegister leaves the error for the next
    launch (on a throwaway thread, so this process stays clean)."""
    import torch

    answer: list[bool | str] = []

    def run() -> None:
        try:
            torch.cuda.set_device(device)
            buf = torch.empty(1 << 16, dtype=torch.uint8)
            rt = torch.cuda.cudart()
            first = int(rt.cudaHostRegister(buf.data_ptr(), buf.numel(), 0))
            second = int(rt.cudaHostRegister(buf.data_ptr(), buf.numel(), 0))
            try:
                _launch(device)
                answer.append(False)
            except RuntimeError:
                answer.append(True)
            finally:
                if first == 0:
                    rt.cudaHostUnregister(buf.data_ptr())
            if second == 0:
                answer[-1] = "the second registration did not fail"
        except Exception as exc:
            answer.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return answer[0]


def host_register_error(platform: Platform) -> dict[str, Any]:
    """A failed host registration, then a kernel launch on the same thread."""
    reason = skip_reason(platform)
    if reason:
        return {"skipped": reason}
    import torch

    device = platform.torch_device(0)
    buf = torch.empty(1 << 20, dtype=torch.uint8)
    handle = platform.register_host_memory(buf)
    if handle is None:
        raise RuntimeError("registering a fresh 1 MiB buffer failed")
    try:
        refused = platform.register_host_memory(buf) is None  # already registered
        _launch(device)  # raises if the failed call left its error on this thread
    finally:
        platform.unregister_host_memory(handle)
    return {"second_registration_refused": refused, "launch_after_failure_ok": True,
            "raw_binding_leaves_error": _raw_binding_leaves_error(device), "ok": refused}


def rank_child(rank: int) -> dict[str, Any]:
    """One rank's device agreement, in this (child) process."""
    import torch

    from diffrt.engine.pipeline_runner import rank_device
    from diffrt.platforms import current_platform as p

    device = rank_device(p, rank)
    x = torch.arange(256, device=device, dtype=torch.float32)
    seen: dict[str, Any] = {}

    def output_thread() -> None:
        side = p.new_side_stream()
        p.wait_event(side, p.record_device_event())
        with p.stream_context(side):
            y = x * 2
        done = p.record_device_event(side)
        p.event_synchronize(done)
        seen.update(side_stream=side.device.index, side_event=_event_device(done),
                    side_result_ok=bool(torch.equal(y.cpu(), torch.arange(256.0) * 2)))

    thread = threading.Thread(target=output_thread)
    thread.start()
    thread.join()
    seen.update(rank=rank, device=device.index, tensor=x.device.index,
                current_stream=p.current_stream().device.index,
                event=_event_device(p.record_device_event()))
    indices = [seen[k] for k in ("tensor", "current_stream", "side_stream", "event",
                                 "side_event") if seen.get(k) is not None]
    seen["ok"] = bool(seen["side_result_ok"]) and set(indices) == {device.index}
    return seen


def _event_device(event: Any) -> int | None:
    device = getattr(event, "device", None)
    return getattr(device, "index", None)


def rank_devices(platform: Platform, ranks: int | None = None) -> dict[str, Any]:
    """``rank_child`` for each rank (one per visible device, at least two)."""
    reason = skip_reason(platform)
    if reason:
        return {"skipped": reason}
    n = ranks or max(2, platform.device_count())
    results = []
    for rank in range(n):
        code = f"import json; from diffrt.cli.gpu_checks import rank_child; " \
               f"print(json.dumps(rank_child({rank})))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=RANK_TIMEOUT_S)
        if out.returncode != 0:
            tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
            results.append({"rank": rank, "ok": False, "error": tail})
        else:
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {"ranks": results, "ok": all(r["ok"] for r in results)}
