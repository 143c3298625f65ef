"""The runner's execution of ticks: REQUEST_BATCH's fused forwards and
STEP_BATCH's prepare / advance / decode, with their failure isolation.

A batch that fails is retried one request at a time, so the error lands on
the request that caused it and the others still get their output — unless
several ranks share the work: then a rank-local failure ends the rank
(``RankFailure``; retrying alone would call collectives its peers are not
in). ``TickRunner`` is the base of ``PipelineRunner``, which builds the
pipeline and keeps the request states.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from diffrt.engine.input_images import InputPixels, read_pixels
from diffrt.engine.pipelines.interface import (
    DiffusionPipeline,
    DiffusionRequestBatch,
    StepRequestState,
)
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.runner_messages import (
    ExecuteBatch,
    ExecuteStep,
    RequestAdapters,
    StepReport,
    TickReport,
)
from diffrt.runtime.shm_transport import Arena
from diffrt.runtime.types import RankFailure, RunnerResult

if TYPE_CHECKING:
    from diffrt.platforms.interface import Platform

logger = logging.getLogger(__name__)


def describe_error(exc: BaseException) -> str:
    if is_out_of_memory(exc):
        return f"device out of memory: {type(exc).__name__}: {exc}"
    return f"{type(exc).__name__}: {exc}"


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError, or a vendor's RuntimeError saying so (torch_npu,
    torch_musa and older stacks raise plain RuntimeErrors)."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


#: request id -> its output tensor of this tick
Outputs = dict[str, Any]


class _OfRequest(Protocol):
    """A request or its step state: what a failure's error is filed under."""

    @property
    def request_id(self) -> str: ...


_Item = TypeVar("_Item", bound=_OfRequest)


class TickRunner:
    """Runs ``ExecuteBatch`` and ``ExecuteStep`` on ``pipeline``; see the module."""

    pipeline: DiffusionPipeline
    #: several ranks share each request: a rank-local failure ends the rank
    parallel: bool
    #: the decode is split over the ranks too
    vae_parallel: bool
    #: STEP_BATCH request state, by request id
    states: dict[str, StepRequestState]

    platform: Platform
    #: the input arena's mapping in this process (set by the worker core;
    #: None where the executor carries no inputs)
    inputs: Arena | None = None

    def _inputs_of(self, request: DiffusionRequest) -> InputPixels | None:
        """The request's input images, copied out of the input arena."""
        spec = self.pipeline.spec
        return read_pixels(request, self.inputs, lambda w, h: spec.input_size(request, w, h),
                           spec.prompt_image_size(request))

    def _slots(self, uses: RequestAdapters) -> tuple[tuple[int, float], ...]:
        """A request's (slot, scale) pairs, each slot checked to hold the adapter
        the engine assigned it (a mismatch is a bug: never other pixels)."""
        for slot, adapter_id, _ in uses:
            entry = self.pipeline.row_loras.installed[slot]
            if entry is None or entry[0] != adapter_id:
                raise RuntimeError(f"LoRA slot {slot} does not hold adapter {adapter_id}")
        return tuple((slot, scale) for slot, _, scale in uses)

    def _failed(self, exc: BaseException) -> str:
        """The error a request gets for ``exc``; after an out-of-memory error the
        device's cached memory is given back first, so the retries (one request
        at a time) and the next ticks start from a clean allocator."""
        if is_out_of_memory(exc):
            logger.warning("device out of memory (%s); freeing the cache", exc)
            try:
                self.platform.empty_cache()
            except Exception:
                logger.exception("empty_cache failed")
        return describe_error(exc)

    def _isolate(self, exc: BaseException, items: list[_Item], errors: dict[str, str],
                 what: str, alone: Callable[[_Item], None]) -> None:
        """After ``exc`` failed the work of ``items`` together: a lone item gets
        the error; several are run again each ``alone``, so the error lands on
        the request that caused it."""
        if len(items) == 1:
            errors[items[0].request_id] = self._failed(exc)
            return
        logger.warning("%s of %d failed (%s); one at a time", what, len(items), self._failed(exc))
        for item in items:
            alone(item)

    def _end_if_shared(self, exc: BaseException) -> None:
        """With several ranks, a failure inside work they share ends this rank
        (``RankFailure``): retrying alone would call collectives its peers are
        not in."""
        if self.parallel:
            raise RankFailure(f"failed in work shared with the other ranks: "
                              f"{describe_error(exc)}") from exc

    # -- REQUEST_BATCH ------------------------------------------------------------
    def execute_batch(self, batch: ExecuteBatch) -> RunnerResult:
        outputs: Outputs = {}
        errors: dict[str, str] = {}
        self._forward_or_isolate(batch.requests, outputs, errors, batch.request_adapters)
        return RunnerResult(reply=TickReport(errors=errors), outputs=outputs)

    def _forward_or_isolate(self, requests: list[DiffusionRequest], outputs: Outputs,
                            errors: dict[str, str], request_adapters: dict[str, RequestAdapters]) -> None:
        """The requests' fused forward; on a failure, each alone."""
        try:
            self._forward(requests, outputs, request_adapters)
        except Exception as exc:
            self._end_if_shared(exc)
            self._isolate(exc, requests, errors, "fused batch", lambda r: self._forward_or_isolate(
                [r], outputs, errors, request_adapters))

    def _forward(self, requests: list[DiffusionRequest], outputs: Outputs,
                 request_adapters: dict[str, RequestAdapters]) -> None:
        loras = [self._slots(request_adapters.get(r.request_id, [])) for r in requests]
        inputs = [self._inputs_of(r) for r in requests]
        results = self.pipeline.forward(DiffusionRequestBatch(
            requests=list(requests), loras=loras if any(loras) else [],
            inputs=inputs if any(i is not None for i in inputs) else []))
        if len(results) != len(requests):
            raise RuntimeError(
                f"pipeline returned {len(results)} outputs for {len(requests)} requests")
        # all or nothing: a batch that fails leaves no output of its own behind
        outputs.update({request.request_id: self.pipeline.to_transfer(tensor, request.sampling_params)
                        for request, tensor in zip(requests, results, strict=True)})

    # -- STEP_BATCH -----------------------------------------------------------------
    def execute_step(self, step: ExecuteStep) -> RunnerResult:
        report = StepReport()
        reply = TickReport(step=report)
        errors = reply.errors
        outputs: Outputs = {}
        for rid in step.drop:
            self._forget(rid)
        self._prepare(step.new, errors, step.request_adapters)
        if self.parallel and step.new:
            self._agree_on_prepared(step.new, errors)
        states = []
        for rid in step.advance:
            if rid in errors:
                continue
            if rid not in self.states:
                errors[rid] = "RuntimeError: no step state for this request in the worker"
                continue
            states.append(self.states[rid])
        for run in range(1, max(1, step.steps) + 1):
            self._advance(states, errors)
            report.steps_run = run
            if any(self._boundary(state, errors) for state in states):
                break  # the batch changes here: back to the engine
        finished_states = []
        for state in states:
            rid = state.request_id
            if rid in errors:
                self._forget(rid)
            elif state.finished:
                self._forget(rid)
                finished_states.append(state)
            else:
                report.steps[rid] = state.step
                if step.report_state_bytes:
                    report.state_bytes[rid] = state.nbytes()
                self._preview(state, report, outputs)
        self._decode(finished_states, reply, outputs)
        for state in states:  # a failure still reports the steps it had done
            if state.request_id in errors and state.step:
                report.steps.setdefault(state.request_id, state.step)
        return RunnerResult(reply=reply, outputs=outputs)

    def _forget(self, rid: str) -> None:
        """Drop a request's step state; its step cache's tensors go at once."""
        state = self.states.pop(rid, None)
        if state is not None and state.cache is not None and not state.finished:
            state.cache.free()  # a finished one's metrics are taken when it is decoded

    @staticmethod
    def _boundary(state: StepRequestState, errors: dict[str, str]) -> bool:
        """After this step ``state`` leaves the batch or wants an output."""
        return (state.request_id in errors or state.finished
                or state.step in state.request.sampling_params.preview_steps())

    def _preview(self, state: StepRequestState, report: StepReport, outputs: Outputs) -> None:
        """A running request at one of its preview steps: its predicted image
        goes out as this tick's output. A failed preview is logged, not fatal:
        the request goes on to its final image."""
        steps = state.request.sampling_params.preview_steps()
        if state.step not in steps:
            return
        try:
            image = self.pipeline.decode_preview(state)
            if image is not None:
                outputs[state.request_id] = self.pipeline.to_transfer(
                    image, state.request.sampling_params)
                report.previews[state.request_id] = steps.index(state.step)
        except Exception as exc:
            if self.vae_parallel:
                self._end_if_shared(exc)
            logger.warning("preview of %s failed: %s", state.request_id, describe_error(exc))

    def _prepare(self, requests: list[DiffusionRequest], errors: dict[str, str],
                 request_adapters: dict[str, RequestAdapters]) -> None:
        """Prepare the requests admitted in this tick together (one text-encoder
        call); on a failure, one by one so the error lands on its own request."""
        if not requests:
            return
        states = []
        for r in requests:
            try:
                states.append(StepRequestState(
                    request=r, loras=self._slots(request_adapters.get(r.request_id, [])),
                    inputs=self._inputs_of(r)))
            except (RuntimeError, ValueError) as exc:  # an empty adapter slot, an unreadable
                errors[r.request_id] = describe_error(exc)  # input: it fails alone
        requests = [s.request for s in states]
        if not states:
            return
        try:
            self.pipeline.prepare_encode_batch(states)
        except Exception as exc:
            self._isolate(exc, requests, errors, "preparing",
                          lambda r: self._prepare([r], errors, request_adapters))
            return
        for state in states:
            self.states[state.request_id] = state

    def _agree_on_prepared(self, requests: list[DiffusionRequest],
                           errors: dict[str, str]) -> None:
        """With several ranks, keep a new request only where every rank prepared
        it (preparing is local: a rank-local failure, out of memory on one
        device, must not leave the ranks with different batches)."""
        import torch.distributed as dist

        here = torch.tensor([r.request_id in self.states for r in requests], dtype=torch.int32,
                            device=self.pipeline.device)
        dist.all_reduce(here, op=dist.ReduceOp.MIN)
        for request, everywhere in zip(requests, here.tolist(), strict=True):
            rid = request.request_id
            if not everywhere and rid in self.states:
                self._forget(rid)
                errors.setdefault(rid, "RuntimeError: preparing it failed on another rank")

    def _decode(self, states: list[StepRequestState], reply: TickReport,
                outputs: Outputs) -> None:
        """Decode the requests that finished in this tick in one call; on a
        failure, one by one so the error lands on its own request."""
        if not states:
            return
        assert reply.step is not None
        try:
            decoded = self.pipeline.post_decode_batch(states)
            if len(decoded) != len(states):
                raise RuntimeError(f"post_decode_batch returned {len(decoded)} outputs "
                                   f"for {len(states)} requests")
        except Exception as exc:
            if self.vae_parallel:
                self._end_if_shared(exc)
            self._isolate(exc, states, reply.errors, "decoding",
                          lambda s: self._decode([s], reply, outputs))
            return
        for state, out in zip(states, decoded, strict=True):
            rid = state.request_id
            try:
                outputs[rid] = self.pipeline.to_transfer(out, state.request.sampling_params)
                reply.step.finished.append(rid)
            except Exception as exc:
                reply.errors[rid] = self._failed(exc)

    def _advance(self, states: list[StepRequestState], errors: dict[str, str]) -> None:
        """One denoise step for all ``states``; on a batch failure, retry each alone."""
        if not states:
            return
        try:
            preds = self._denoise(states)
        except Exception as exc:
            self._end_if_shared(exc)
            self._isolate(exc, states, errors, "step batch",
                          lambda s: self._advance([s], errors))
            return
        for state, pred in zip(states, preds, strict=True):
            try:
                self.pipeline.apply_step(state, pred)
            except Exception as exc:
                errors[state.request_id] = self._failed(exc)

    def _denoise(self, states: list[StepRequestState]) -> list[torch.Tensor]:
        pred = self.pipeline.denoise_step(states)
        rows = sum(s.latents.shape[0] if s.latents is not None else 1 for s in states)
        if pred.shape[0] != rows:
            raise RuntimeError(f"denoise_step returned {pred.shape[0]} rows for {rows}")
        return self.pipeline.split_predictions(pred, states)


__all__ = ["TickRunner", "describe_error", "is_out_of_memory"]
