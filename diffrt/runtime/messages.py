"""Every message that crosses the runtime's channels, as msgspec Structs.

Three channels, one tagged union and one Decoder each:

* request channel (executor -> every worker): ``InitWorker``, ``Rpc``, ``Shutdown``;
* result channel (each worker -> executor pump): ``RpcResult``, ``ComputeDone``,
  ``OutputReady``, ``OutputPending`` (their tags are the ``AsyncOutputKind`` values);
* free channel (executor -> output rank's output thread): ``FreeSlots``.

Tensors never travel inside messages: ``OutputReady`` carries ``KeyOutput``
entries whose tree references slots of the shared-memory arena. The runner's
own messages (its settings, requests and replies: see ``RunnerProtocol``)
travel inside the envelopes as pre-encoded ``msgspec.Raw``: a request is
encoded once for all ranks, the envelope decodes without knowing the runner,
and each side decodes the inner message with the runner's typed decoder.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec


class AsyncOutputKind(str, enum.Enum):
    """How the pump routes a result message of the two-phase output protocol."""

    RPC_RESULT = "rpc_result"      # ordinary RPC return, errors included
    COMPUTE_DONE = "compute_done"  # forward finished; the worker takes the next request
    OUTPUT_READY = "output_ready"  # outputs are in shared memory, ready to read
    OUTPUT_PENDING = "output_pending"  # outputs wait for arena room (a slow consumer)
    HEARTBEAT = "heartbeat"        # the runner made progress inside a long execute


#: msgpack's nil: an empty reply.
NIL = msgspec.Raw(b"\xc0")


class RpcKind(enum.IntEnum):
    EXECUTE = 0     # two-phase: COMPUTE_DONE (+ OUTPUT_READY), rank 0 replies
    COLLECTIVE = 1  # control path: every rank replies with RPC_RESULT


# -- request channel ------------------------------------------------------------
class RequestMsg(msgspec.Struct, tag=True, array_like=True, gc=False):
    pass


class InitWorker(RequestMsg, tag="init"):
    rank: int
    world_size: int
    runner_cls: str                # "pkg.module:Class"
    runner_settings: msgspec.Raw   # the runner's settings Struct
    async_output: bool
    arena_bytes: int
    output_queue_depth: int
    #: the input arena's size (0: none; ``input_arena``)
    input_arena_bytes: int = 0
    dist_init_method: str | None = None
    rpc_id: int = 0  # the rank acknowledges start-up with RpcResult(rpc_id)


class Rpc(RequestMsg, tag="rpc"):
    rpc_id: int
    request: msgspec.Raw           # one of the runner's request Structs
    kind: RpcKind = RpcKind.EXECUTE


class Shutdown(RequestMsg, tag="shutdown"):
    pass


RequestUnion = InitWorker | Rpc | Shutdown


# -- result channel ---------------------------------------------------------------
class TensorMeta(msgspec.Struct, array_like=True, gc=False):
    """Where one tensor lies inside its key's slot."""

    offset: int          # bytes from the slot's start
    dtype: str           # e.g. "bfloat16"
    shape: list[int]


class KeyOutput(msgspec.Struct, array_like=True, gc=False):
    """One key's output: its slot in the arena and how to rebuild the value."""

    output_id: str
    slot_offset: int
    slot_bytes: int
    generation: int
    tensors: list[TensorMeta]
    # Nested structure: ["T", i] tensor i, ["L", [...]] list, ["U", [...]] tuple,
    # ["D", [[k, node], ...]] dict, ["V", value] a plain msgspec-encodable value.
    tree: Any
    nbytes: int = 0


class ResultMsg(msgspec.Struct, tag=True, array_like=True, gc=False):
    @property
    def kind(self) -> AsyncOutputKind:
        return AsyncOutputKind(self.__struct_config__.tag)


class RpcResult(ResultMsg, tag=AsyncOutputKind.RPC_RESULT.value):
    rpc_id: int
    rank: int
    reply: msgspec.Raw = NIL                 # the runner's reply Struct, or nil
    error: str | None = None                 # "Type: message", one line for the user
    traceback: str | None = None             # the worker's traceback, for the log


class ComputeDone(ResultMsg, tag=AsyncOutputKind.COMPUTE_DONE.value):
    rpc_id: int
    rank: int
    reply: msgspec.Raw = NIL
    async_output_id: str | None = None       # None on the synchronous path
    output_ids: dict[str, str] = {}          # key -> per-key output id


class OutputReady(ResultMsg, tag=AsyncOutputKind.OUTPUT_READY.value):
    async_output_id: str                     # batch-level id
    outputs: list[KeyOutput] = []
    error: str | None = None
    failed_ids: list[str] = []               # per-key ids that failed with ``error``
    skipped_ids: list[str] = []              # released before they were packed


#: how often the writer repeats OutputPending while outputs wait for arena room.
PENDING_NOTICE_S = 1.0


class OutputPending(ResultMsg, tag=AsyncOutputKind.OUTPUT_PENDING.value):
    """These outputs are computed but wait for room in the arena: their waiters
    must not time out while consumers of other outputs are slow to read."""

    async_output_id: str
    output_ids: list[str] = []


class Heartbeat(ResultMsg, tag=AsyncOutputKind.HEARTBEAT.value):
    """A sign of progress from inside an execute call (one per denoise step,
    at most one per ``HEARTBEAT_MIN_S``): the watchdog then tells a long
    request-batch forward from a hung one."""

    rank: int


#: the least time between two heartbeats of a rank.
HEARTBEAT_MIN_S = 0.5

ResultUnion = RpcResult | ComputeDone | OutputReady | OutputPending | Heartbeat


# -- free channel ------------------------------------------------------------------
class FreeSlots(msgspec.Struct, array_like=True, gc=False):
    slots: list[tuple[int, int]] = []        # (slot offset, generation) of released leases
    #: output ids the executor will never read (aborted, timed out, orphaned): free their
    #: slots even if their OUTPUT_READY was lost, or skip packing them if not done yet.
    ids: list[str] = []


def output_ids_for(rpc_id: int, keys: list[str]) -> tuple[str, dict[str, str]]:
    """Batch id and per-key ids of one execute RPC. Deterministic on both sides,
    so splitting a batch never depends on which message arrives first."""
    batch = f"out-{rpc_id}"
    return batch, {k: f"{batch}/{i}" for i, k in enumerate(keys)}


_enc = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(RequestUnion)
result_decoder = msgspec.msgpack.Decoder(ResultUnion)
free_decoder = msgspec.msgpack.Decoder(FreeSlots)


def encode(msg: Any) -> bytes:
    return _enc.encode(msg)


def encode_raw(value: Any) -> msgspec.Raw:
    """Encode an inner message once, to travel inside an envelope."""
    return msgspec.Raw(_enc.encode(value))
