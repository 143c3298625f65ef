"""What the engine asks of the pipeline runner in each worker, and its replies.

Typed msgspec Structs, one tag each; ``PIPELINE_PROTOCOL`` declares them to
the runtime, which builds the typed decoders from it (workers decode requests,
the engine decodes replies). A request that is not declared here fails with
TypeError at the engine before anything is sent.
"""

from __future__ import annotations

import msgspec

from diffrt.engine.model_spec import ModelSpec
from diffrt.engine.outputs import CacheMetrics, TextEncoderStats
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.settings import ModelConfig, ParallelConfig
from diffrt.runtime.types import RunnerProtocol


class RunnerSettings(msgspec.Struct, frozen=True):
    """How each worker builds its pipeline (sent once, at start-up): the
    engine's own settings groups, so a worker has no defaults of its own."""

    #: the model, as the engine resolved it (the worker loads what it describes)
    spec: ModelSpec
    model: ModelConfig = ModelConfig()
    parallel: ParallelConfig = ParallelConfig()


# -- requests -------------------------------------------------------------------------
#: one request's LoRA adapters in a worker: (device slot, adapter id, scale);
#: the id lets the worker check the slot holds what the engine assigned
RequestAdapters = list[tuple[int, int, float]]


class ExecuteBatch(msgspec.Struct, tag="execute_batch"):
    """REQUEST_BATCH: run these whole requests (fused when several)."""

    requests: list[DiffusionRequest]
    #: device slot -> adapter id to copy into it before running (``lora.slot_table``)
    adapter_installs: dict[int, int] = {}
    #: request id -> its adapters' slots and scales (requests without adapters: absent)
    request_adapters: dict[str, RequestAdapters] = {}


class ExecuteStep(msgspec.Struct, tag="execute_step"):
    """STEP_BATCH: prepare ``new``, forget ``drop``, advance ``advance`` by one
    step — or by up to ``steps``, stopping after a step in which a request
    finished, failed or reached a preview."""

    new: list[DiffusionRequest] = []
    advance: list[str] = []
    drop: list[str] = []
    steps: int = 1
    #: as ``ExecuteBatch``'s; ``request_adapters`` for ``new`` (kept with their state)
    adapter_installs: dict[int, int] = {}
    request_adapters: dict[str, RequestAdapters] = {}
    #: the scheduler may pause running requests: report each one's state bytes
    #: (``StepReport.state_bytes``); without preemption nobody reads them
    report_state_bytes: bool = False


class CountStepStates(msgspec.Struct, tag="count_step_states"):
    """How many step-batch request states the worker holds (leak checks)."""


class LoadAdapter(msgspec.Struct, tag="load_adapter"):
    """Start reading an adapter file on the worker's loader thread (answered at
    once with ``AdapterState``; ``AdapterStatus`` asks how far it got)."""

    adapter_id: int
    path: str


class AdapterStatus(msgspec.Struct, tag="adapter_status"):
    adapter_id: int


class DropAdapters(msgspec.Struct, tag="drop_adapters"):
    """Forget these adapters (host copies and device slots)."""

    adapter_ids: list[int]


class CountWeights(msgspec.Struct, tag="count_weights"):
    """The bytes the worker's loaded weights hold (``WeightBytes``)."""


class StageWeights(msgspec.Struct, tag="stage_weights"):
    """Read the transformer's new tensors from ``path`` (a safetensors file
    or folder) beside the live ones and answer their checksum
    (``WeightsStaged``); nothing changes until ``CommitWeights``."""

    path: str


class CommitWeights(msgspec.Struct, tag="commit_weights"):
    """Copy the staged tensors into the transformer (sent between ticks);
    ``keep_previous``: keep a host copy of what they replace, for
    ``RevertWeights`` (a commit without it drops an older copy)."""

    keep_previous: bool = False


class RevertWeights(msgspec.Struct, tag="revert_weights"):
    """Copy back what the last ``CommitWeights(keep_previous=True)`` replaced
    (sent between ticks); answers the checksum of what it put back."""


class ForgetPreviousWeights(msgspec.Struct, tag="forget_previous_weights"):
    """Drop the host copy ``CommitWeights(keep_previous=True)`` kept."""


class DiscardWeights(msgspec.Struct, tag="discard_weights"):
    """Forget the staged tensors: the old weights stay."""


class SleepWorkers(msgspec.Struct, tag="sleep_workers"):
    """Put the weights away (``weights.sleep``): level 1 to page-locked host
    memory, level 2 the transformer's dropped too (sent between ticks)."""

    level: int = 1


class WakeWorkers(msgspec.Struct, tag="wake_workers"):
    """Bring the weights back to the device."""


RunnerRequest = (ExecuteBatch | ExecuteStep | CountStepStates | LoadAdapter | AdapterStatus
                 | DropAdapters | CountWeights | StageWeights | CommitWeights | DiscardWeights
                 | RevertWeights | ForgetPreviousWeights | SleepWorkers | WakeWorkers)


# -- replies ----------------------------------------------------------------------------
class StepReport(msgspec.Struct):
    """STEP_BATCH's part of a ``TickReport``: where each request got to."""

    #: request id -> denoise steps done (its step), for requests still running.
    steps: dict[str, int] = {}
    #: ids decoded in this tick (their outputs travel on the output path).
    finished: list[str] = []
    #: id -> preview index (0-based), for running requests whose output in
    #: this tick is a preview (``partial_images``).
    previews: dict[str, int] = {}
    #: denoise steps this call ran (``ExecuteStep.steps`` or fewer)
    steps_run: int = 1
    #: request id -> the bytes its step state holds (``StepRequestState.nbytes``),
    #: for requests still running: what pausing it would keep in the worker
    state_bytes: dict[str, int] = {}


class TickReport(msgspec.Struct, tag="tick_report"):
    """The runner's answer to one execute (``ExecuteBatch`` or ``ExecuteStep``):
    what every tick reports, and in STEP_BATCH where the requests got to
    (``step``). In REQUEST_BATCH a request without an error has its output."""

    #: request id -> error, for requests that failed.
    errors: dict[str, str] = {}
    #: text encoding done in this tick (None: the pipeline does not count it;
    #: in STEP_BATCH new requests are encoded when prepared).
    text_encoding: TextEncoderStats | None = None
    #: request id -> text encoder -> tokens it cut from the request's prompts
    #: (only requests encoded in this tick that lost some)
    prompt_tokens_dropped: dict[str, dict[str, int]] = {}
    #: the most the worker held above its warm baseline during this execute,
    #: in bytes (None: no baseline yet, or the platform cannot tell)
    peak_memory_bytes: int | None = None
    #: the memory free to the worker when it took its warm baseline (only in
    #: the reply of the execute that took it)
    free_memory_bytes: int | None = None
    #: LoRA slots of this execute's ``adapter_installs`` that stayed empty (the
    #: adapter could not be copied there): the engine forgets the assignment
    empty_adapter_slots: list[int] = []
    #: request id -> what its step cache did, for requests that finished with one
    cache: dict[str, CacheMetrics] = {}
    #: STEP_BATCH: the steps, finishes and previews (None: a REQUEST_BATCH tick)
    step: StepReport | None = None


class StepStateCount(msgspec.Struct, tag="step_state_count"):
    count: int
    #: bytes the worker's step caches hold (``engine.cache``)
    cache_bytes: int = 0
    #: bytes all its step states hold (``StepRequestState.nbytes``, caches included)
    state_bytes: int = 0


class AdapterState(msgspec.Struct, tag="adapter_state"):
    #: "loading", "ready", or why the file was refused
    state: str
    rank: int = 0
    modules: int = 0
    nbytes: int = 0


class WeightBytes(msgspec.Struct, tag="weight_bytes"):
    #: component ("transformer", "vae", "text_encoder", ...) -> device type
    #: ("cpu", "cuda", ...) -> bytes its weights' storages hold there
    #: (``engine.weights.resident``)
    components: dict[str, dict[str, int]]
    #: the weight method each component runs with ("none": as loaded)
    methods: dict[str, str] = {}
    #: component -> bytes of its weights kept in page-locked host memory and
    #: moved to the device to run (``offload``, ``offload_text_encoders``)
    offloaded: dict[str, int] = {}
    #: the weights' bytes on the device at their peak: what stays there, the
    #: layer-wise slots, the largest component model offload moves on
    on_device: int = 0


class WeightsStaged(msgspec.Struct, tag="weights_staged"):
    """A rank's answer to ``StageWeights`` (and to commit / discard): the
    checksum of what it read (``weights.update.checksum``), or why it could
    not read it; to ``RevertWeights``, of what it put back."""

    checksum: str = ""
    tensors: int = 0
    nbytes: int = 0
    error: str | None = None


class SleepReport(msgspec.Struct, tag="sleep_report"):
    """A rank's answer to ``SleepWorkers`` / ``WakeWorkers``: the bytes the
    device gave up (and those kept in page-locked memory), or got back;
    whether waking read the transformer from its folder again (level 2)."""

    freed_bytes: int = 0
    pinned_bytes: int = 0
    restored_bytes: int = 0
    reloaded: bool = False


RunnerReply = (TickReport | StepStateCount | AdapterState | WeightBytes | WeightsStaged
               | SleepReport)

PIPELINE_PROTOCOL = RunnerProtocol(settings=RunnerSettings, requests=RunnerRequest,
                                   replies=RunnerReply)
