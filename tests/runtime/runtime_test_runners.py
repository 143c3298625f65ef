"""Trivial runner classes for runtime tests (no diffusers; cheap to import in workers)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch

from diffrt.runtime.runner import RunnerResult

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "uint8": torch.uint8, "int64": torch.int64, "bool": torch.bool}


def make_tensor(seed: int, shape: list[int], dtype: str) -> torch.Tensor:
    """Deterministic content both sides can rebuild."""
    n = 1
    for s in shape:
        n *= s
    base = (torch.arange(n, dtype=torch.int64) * 7 + seed * 131) % 251
    if dtype == "bool":
        return (base % 2 == 0).view(shape)
    t = base.to(DTYPES[dtype])
    if DTYPES[dtype].is_floating_point:
        t = t / 8 - 3
    return t.view(shape)


class EchoRunner:
    def __init__(self, rank: int, world_size: int, platform: Any, **kwargs: Any):
        self.rank = rank
        self.world_size = world_size
        self.platform = platform
        self.kwargs = kwargs
        self.calls = 0
        self.closed = False
        self.gate = threading.Event()

    # -- execute methods (return RunnerResult) ---------------------------------------
    def make(self, p: dict) -> RunnerResult:
        """{"keys": [...], "shape": [...], "dtype": str, "layout": "contiguous"|"transposed"|"slice"}"""
        self.calls += 1
        dtype = p.get("dtype", "float32")
        shape = p.get("shape", [2, 3])
        layout = p.get("layout", "contiguous")
        outputs = {}
        if layout == "slice":  # one batched tensor, each key a view of its row
            batch = torch.stack([make_tensor(i, shape, dtype) for i in range(len(p["keys"]))])
            outputs = {k: batch[i] for i, k in enumerate(p["keys"])}
        else:
            for i, k in enumerate(p["keys"]):
                t = make_tensor(i, shape, dtype)
                if layout == "transposed":
                    t = make_tensor(i, shape[::-1], dtype).t()
                outputs[k] = t
        return RunnerResult(meta={"rank": self.rank, "calls": self.calls, "keys": p["keys"]},
                            outputs=outputs)

    def nested(self, p: dict) -> RunnerResult:
        return RunnerResult(meta=None, outputs={"n": {
            "images": [make_tensor(0, [2, 2], "uint8"), make_tensor(1, [3], "bfloat16")],
            "pair": (make_tensor(2, [1], "float16"), "label", 3),
            "empty": torch.empty(0, 4),
            "scalar": torch.tensor(2.5),
        }})

    def echo(self, p: Any) -> RunnerResult:
        return RunnerResult(meta=p)

    def fail(self, p: Any) -> RunnerResult:
        raise ValueError(f"boom {p}")

    def fail_on_rank(self, p: int) -> RunnerResult:
        if self.rank == p:
            raise ValueError(f"boom on rank {p}")
        return RunnerResult(meta="ok")

    def sleep_then_make(self, p: dict) -> RunnerResult:
        time.sleep(p["sleep_s"])
        return self.make(p)

    def wrong_type(self, p: Any) -> Any:
        return 42

    # -- collective methods (return builtins) ------------------------------------------
    def pid(self, p: Any = None) -> int:
        return os.getpid()

    def info(self, p: Any = None) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "kwargs": self.kwargs,
                "platform": self.platform.name, "calls": self.calls}

    def allreduce(self, p: float) -> float:
        import torch.distributed as dist

        t = torch.tensor([float(p) * (self.rank + 1)])
        dist.all_reduce(t)
        return float(t.item())

    def close(self) -> None:
        self.closed = True


class LateKernelRunner(EchoRunner):
    """On a simulated async device: forward's output is written by a kernel that runs
    late on the compute stream, as on a GPU where forward only enqueues work."""

    def make_late(self, p: dict) -> RunnerResult:
        outputs = {}
        for i, k in enumerate(p["keys"]):
            out = torch.zeros(p.get("shape", [64, 64]), dtype=DTYPES[p.get("dtype", "float32")])
            expected = make_tensor(p["seed"] + i, list(out.shape), p.get("dtype", "float32"))
            self.platform.launch(lambda o=out, e=expected: o.copy_(e), delay_s=p.get("kernel_s", 0.05))
            outputs[k] = out
        return RunnerResult(meta={"seed": p["seed"]}, outputs=outputs)
