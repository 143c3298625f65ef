"""Trivial runner classes for runtime tests (no diffusers; cheap to import in workers).

They speak typed messages like the engine's runner: ``ECHO_PROTOCOL`` declares
them, and ``handle`` dispatches with ``match``.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import msgspec
import torch

from diffrt.runtime import RunnerProtocol, RunnerResult

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


class EchoSettings(msgspec.Struct):
    tag: str = ""


# -- execute requests (handle returns RunnerResult) -----------------------------------
class Make(msgspec.Struct, tag="make"):
    """One output per key; layout "contiguous" | "transposed" | "slice" (views of one batch)."""

    keys: list[str]
    shape: list[int] = msgspec.field(default_factory=lambda: [2, 3])
    dtype: str = "float32"
    layout: str = "contiguous"
    sleep_s: float = 0.0   # before computing (a slow forward)
    #: created when the runner starts on the request, so a test can wait for
    #: the worker to be busy in forward instead of sleeping.
    started_path: str = ""


class Nested(msgspec.Struct, tag="nested"):
    pass


class Echo(msgspec.Struct, tag="echo"):
    value: Any = None


class Fail(msgspec.Struct, tag="fail"):
    value: Any = None


class FailOnRank(msgspec.Struct, tag="fail_on_rank"):
    rank: int


class WrongType(msgspec.Struct, tag="wrong_type"):
    """The runner answers with something that is not a RunnerResult."""


class MakeLate(msgspec.Struct, tag="make_late"):
    keys: list[str]
    seed: int
    shape: list[int] = msgspec.field(default_factory=lambda: [64, 64])
    dtype: str = "float32"
    kernel_s: float = 0.05


# -- collective requests (handle returns a reply Struct) ---------------------------------
class Pid(msgspec.Struct, tag="pid"):
    pass


class Info(msgspec.Struct, tag="info"):
    pass


class AllReduce(msgspec.Struct, tag="allreduce"):
    value: float


class NotDeclared(msgspec.Struct, tag="not_declared"):
    """A request no runner protocol lists."""


class ReplyOutsideProtocol(msgspec.Struct, tag="reply_outside_protocol"):
    """The runner answers with a Struct its protocol does not declare."""

    collective: bool = False


# -- replies ------------------------------------------------------------------------------
class Echoed(msgspec.Struct, tag="echoed"):
    value: Any = None


class Made(msgspec.Struct, tag="made"):
    rank: int
    calls: int
    keys: list[str]


class PidReply(msgspec.Struct, tag="pid_reply"):
    pid: int


class InfoReply(msgspec.Struct, tag="info_reply"):
    rank: int
    world_size: int
    tag: str
    platform: str
    calls: int


class Reduced(msgspec.Struct, tag="reduced"):
    value: float


ECHO_PROTOCOL = RunnerProtocol(
    settings=EchoSettings,
    requests=(Make | Nested | Echo | Fail | FailOnRank | WrongType | MakeLate | Pid | Info
              | AllReduce | ReplyOutsideProtocol),
    replies=Echoed | Made | PidReply | InfoReply | Reduced,
)


class EchoRunner:
    protocol = ECHO_PROTOCOL

    def __init__(self, settings: EchoSettings, *, rank: int, world_size: int, platform: Any):
        self.settings = settings
        self.rank = rank
        self.world_size = world_size
        self.platform = platform
        self.calls = 0
        self.closed = False
        self.gate = threading.Event()

    def handle(self, request: Any) -> Any:
        match request:
            case Make():
                return self.make(request)
            case Nested():
                return self.nested()
            case Echo(value=value):
                return RunnerResult(reply=Echoed(value))
            case Fail(value=value):
                raise ValueError(f"boom {value}")
            case FailOnRank(rank=rank):
                if self.rank == rank:
                    raise ValueError(f"boom on rank {rank}")
                return RunnerResult(reply=Echoed("ok"))
            case WrongType():
                return 42
            case ReplyOutsideProtocol(collective=collective):
                bad = NotDeclared()
                return bad if collective else RunnerResult(reply=bad, outputs={"k": torch.ones(4)})
            case Pid():
                return PidReply(os.getpid())
            case Info():
                return InfoReply(self.rank, self.world_size, self.settings.tag, self.platform.name,
                                 self.calls)
            case AllReduce(value=value):
                return Reduced(self.allreduce(value))
            case _:
                raise TypeError(f"{type(self).__name__} cannot handle {type(request).__name__}")

    def make(self, p: Make) -> RunnerResult:
        if p.started_path:
            open(p.started_path, "w").close()
        if p.sleep_s:
            time.sleep(p.sleep_s)
        self.calls += 1
        outputs = {}
        if p.layout == "slice":  # one batched tensor, each key a view of its row
            batch = torch.stack([make_tensor(i, p.shape, p.dtype) for i in range(len(p.keys))])
            outputs = {k: batch[i] for i, k in enumerate(p.keys)}
        else:
            for i, k in enumerate(p.keys):
                t = make_tensor(i, p.shape, p.dtype)
                if p.layout == "transposed":
                    t = make_tensor(i, p.shape[::-1], p.dtype).t()
                outputs[k] = t
        return RunnerResult(reply=Made(self.rank, self.calls, p.keys), outputs=outputs)

    def nested(self) -> RunnerResult:
        return RunnerResult(outputs={"n": {
            "images": [make_tensor(0, [2, 2], "uint8"), make_tensor(1, [3], "bfloat16")],
            "pair": (make_tensor(2, [1], "float16"), "label", 3),
            "empty": torch.empty(0, 4),
            "scalar": torch.tensor(2.5),
        }})

    def allreduce(self, value: float) -> float:
        import torch.distributed as dist

        t = torch.tensor([float(value) * (self.rank + 1)])
        dist.all_reduce(t)
        return float(t.item())

    def close(self) -> None:
        self.closed = True


class LateKernelRunner(EchoRunner):
    """On a simulated async device: forward's output is written by a kernel that runs
    late on the compute stream, as on a GPU where forward only enqueues work."""

    def handle(self, request: Any) -> Any:
        match request:
            case MakeLate():
                return self.make_late(request)
            case _:
                return super().handle(request)

    def make_late(self, p: MakeLate) -> RunnerResult:
        outputs = {}
        for i, k in enumerate(p.keys):
            out = torch.zeros(p.shape, dtype=DTYPES[p.dtype])
            expected = make_tensor(p.seed + i, list(out.shape), p.dtype)
            self.platform.launch(lambda o=out, e=expected: o.copy_(e), delay_s=p.kernel_s)
            outputs[k] = out
        return RunnerResult(reply=Echoed(p.seed), outputs=outputs)
