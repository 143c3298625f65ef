"""The server's side of the engine: start-up, shedding (429/503), one request's
stream, and the drain that ends it all.

Shedding by ``max_pending`` takes a seat among the waiting requests
(``engine/seats.py``) at once, under the engine core's lock: the count
includes the requests accepted but not yet submitted, so a burst cannot pass
the check all together. The seat moves into the engine's queue with the
request and ends when the engine admits it to the running set; ``run`` gives
back a seat whose request never got there (refused at submission, its client
gone first), which is a no-op otherwise.

States: ``starting`` (the engine loads and warms up; /ready is 503),
``ready``, ``draining`` (after SIGTERM: new requests get 503, requests in
flight may finish), ``stopped``, ``failed`` (the engine could not start).
Whether the engine is alive is the engine's to say (``is_healthy``): a worker
that died makes /health 503 in any state. So is whether it is stalled
(``stall``: the worker call in flight has gone ``stall_timeout_s`` without
progress): /health and /ready are 503 until progress resumes, long before the
watchdog kills a hung worker (``execute_timeout_s``). While fresh workers
replace a dead one (``is_restarting``) requests are still taken: the engine
holds them for the fresh workers, up to ``restart_wait_s``.

Every request runs through ``run``, which aborts it in the engine when its
consumer leaves early (a client that disconnected, a cancelled stream), so
nothing keeps running or holding memory for nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from diffrt.engine import DiffusionEngine, DiffusionOutput, DiffusionRequest, EngineConfig
from diffrt.engine.lora.registry import LoraInfo
from diffrt.engine.model_spec import ModelSpec
from diffrt.engine.seats import Seat
from diffrt.serve.errors import ApiError
from diffrt.serve.settings import ServeSettings

logger = logging.getLogger(__name__)

#: how long the drain waits for aborted requests to reach a step boundary
ABORT_GRACE_S = 10.0
#: how often the drain looks at the requests in flight
IDLE_POLL_S = 0.05
#: the longest Retry-After a shed request is told
MAX_RETRY_AFTER_S = 3600


def retry_after(predicted_s: float | None, floor_s: int) -> int:
    """Retry-After, in whole seconds, of a 429 for a full queue: the engine's
    prediction of its next admission (``Seat.retry_after_s``), at least
    ``floor_s`` (``--retry-after-s``, also what is said without a
    prediction) and at most an hour."""
    if predicted_s is None:
        return floor_s
    return max(floor_s, min(MAX_RETRY_AFTER_S, math.ceil(predicted_s)))


def sleeping_refusal(settings: ServeSettings) -> ApiError:
    """The 503 of a request that arrives while the engine (on Ray Serve: the
    deployment) sleeps, with ``sleep_requests="refuse"``."""
    return ApiError(503, "the engine sleeps (POST /wake_up wakes it); retry later",
                    code="sleeping", headers={"Retry-After": str(settings.sleep_retry_after_s)})


class EngineClient:
    #: adapters may be registered and removed while serving (one engine here)
    runtime_loras = True

    def __init__(self, config: EngineConfig | None, settings: ServeSettings, *,
                 engine: DiffusionEngine | None = None,
                 on_ready: Callable[[], None] | None = None,
                 on_failed: Callable[[str], None] | None = None):
        if config is None:
            if engine is None:
                raise ValueError("EngineClient needs an EngineConfig or a started engine")
            config = engine.config
        self.config = config
        self.settings = settings
        self.engine = engine
        self.state = "starting" if engine is None else "ready"
        self.failure: str | None = None
        self._on_ready = on_ready
        self._on_failed = on_failed
        self._in_flight = 0
        self._running: dict[str, None] = {}  # ids in flight, in arrival order
        #: the drain stopped waiting for aborted requests: their handlers answer
        #: 503 at once (a request-batch forward cannot be cut short). Flags polled
        #: rather than asyncio Events, which bind to one event loop.
        self._gave_up = False
        #: a second signal: the drain stops waiting for requests to finish
        self._hurry = False
        self._owns_engine = engine is None

    @property
    def model_name(self) -> str:
        return self.settings.model_name or self.config.model

    @property
    def step_execution(self) -> bool:
        return self.config.step_execution

    def model_spec(self) -> ModelSpec | None:
        """The served model's description (``/v1/models`` shows it)."""
        return self.config.model_spec()

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Build and warm up the engine off the event loop (minutes for a large
        checkpoint), while /health and /ready answer. Not begun once the
        server drains or stops; an engine built after ``close`` is closed."""
        if self.engine is None:
            if self.state != "starting":  # shut down before its turn came
                return
            try:
                engine = await asyncio.to_thread(DiffusionEngine.make_engine, self.config)
                if self.state == "stopped":  # closed while it loaded
                    await asyncio.to_thread(engine.close)
                    return
                self.engine = engine
            except Exception as exc:
                self.state, self.failure = "failed", f"{type(exc).__name__}: {exc}"
                logger.error("engine failed to start: %s", self.failure)
                if self._on_failed is not None:
                    self._on_failed(self.failure)
                return
        if self.state == "starting":
            self.state = "ready"
            if self._on_ready is not None:
                self._on_ready()

    async def drain(self, timeout_s: float) -> None:
        """Refuse new work, give requests in flight ``timeout_s`` to finish,
        then abort the rest (their clients get an error) and wait for their
        handlers to answer."""
        if self.state in ("draining", "stopped"):
            return
        self.state = "draining"
        logger.info("draining: %d request(s) in flight, up to %.1f s", self._in_flight, timeout_s)
        if await self._until_idle(timeout_s):
            return
        logger.warning("shutdown timeout: aborting %d request(s)", self._in_flight)
        for rid in list(self._running):
            self.engine.abort(rid)  # type: ignore[union-attr]
        if await self._until_idle(ABORT_GRACE_S):
            return
        logger.log(logging.INFO if self._hurry else logging.ERROR,
                   "%d request(s) still running after their abort; answering them 503",
                   self._in_flight)
        self._gave_up = True
        await self._until_idle(ABORT_GRACE_S, hurry=False)  # their handlers answer

    def abort_running(self) -> int:
        """Abort every request in flight (they end aborted: answered 503);
        how many. Safe from any thread (a Ray replica's, when the
        application's drain is to end now)."""
        engine = self.engine
        rids = list(self._running)
        if engine is not None:
            for rid in rids:
                engine.abort(rid)
        return len(rids) if engine is not None else 0

    def end_drain(self) -> None:
        """Stop waiting for requests in flight: they are aborted and answered 503
        at once (a second SIGTERM during the drain)."""
        self._hurry = True

    async def _until_idle(self, timeout_s: float, *, hurry: bool = True) -> bool:
        """True once no request is in flight, False after ``timeout_s`` (or at
        once after ``end_drain``, unless ``hurry`` is False)."""
        give_up_at = time.monotonic() + timeout_s
        while self._in_flight and time.monotonic() < give_up_at and not (hurry and self._hurry):
            await asyncio.sleep(IDLE_POLL_S)
        return self._in_flight == 0

    async def close(self) -> None:
        """Stop the engine (workers exit, the shared-memory arena is freed);
        idempotent."""
        self.state = "stopped"
        if self.engine is not None and self._owns_engine:
            await asyncio.to_thread(self.engine.close)  # close() is idempotent

    def healthy(self) -> bool:
        return self.engine is not None and self.engine.is_healthy()

    def restarting(self) -> bool:
        """Fresh workers are starting: not healthy, but taking requests."""
        return self.engine is not None and self.engine.is_restarting()

    def stall(self) -> str | None:
        """Why the engine makes no progress now (``DiffusionEngine.stall``), or None."""
        return None if self.engine is None else self.engine.stall()

    def ready(self) -> bool:
        return self.state == "ready" and self.healthy() and self.stall() is None

    def sleeping(self) -> bool:
        """The engine sleeps (``POST /sleep``): /health says so."""
        return self.engine is not None and self.engine.sleeping

    # -- requests ------------------------------------------------------------------------
    def engine_or_shed(self, on_admitted: Callable[[], None] | None = None
                       ) -> tuple[DiffusionEngine, Seat]:
        """The engine and the request's seat among the waiting, if it takes
        work now; else the 503/429 that sheds the request."""
        if self.state == "starting":
            raise ApiError(503, "the model is still loading; retry shortly",
                           code="warming_up", headers={"Retry-After": "5"})
        if self.state in ("draining", "stopped"):
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        if self.state == "failed" or not (self.healthy() or self.restarting()):
            reason = self.failure or "the engine is not healthy"
            raise ApiError(503, f"the engine is down: {reason}", code="engine_down")
        assert self.engine is not None
        if self.engine.sleeping and self.settings.sleep_requests == "refuse":
            raise sleeping_refusal(self.settings)
        seat = self.engine.take_seat(self.settings.max_pending, on_admitted=on_admitted)
        if not seat.taken:
            retry = retry_after(seat.retry_after_s, self.settings.retry_after_s)
            raise ApiError(429, f"{seat.waiting} requests are waiting (max_pending="
                                f"{self.settings.max_pending}); retry in {retry} s",
                           code="rate_limit_exceeded", headers={"Retry-After": str(retry)})
        return self.engine, seat

    async def run(self, request: DiffusionRequest, *,
                  on_admitted: Callable[[], None] | None = None
                  ) -> AsyncGenerator[DiffusionOutput, None]:
        """The request's outputs (progress, previews, then the final one); a
        consumer that leaves before the final one aborts the request. Raises
        ApiError (503/429) when the server takes no work, InvalidRequestError
        or an EngineError at submission (on the first item). ``on_admitted``:
        see ``DiffusionEngine.take_seat``."""
        engine, seat = self.engine_or_shed(on_admitted)
        outputs = self._seated(engine, seat, request)
        try:
            async for out in outputs:
                yield out
        finally:  # a consumer that left: the request is aborted there
            await outputs.aclose()

    async def check(self, request: DiffusionRequest) -> None:
        """What the engine would refuse of ``request`` at submission
        (``InvalidRequestError``; ``DiffusionEngine.check``), submitting
        nothing; nothing to say before the engine has started."""
        if self.engine is not None:
            self.engine.check(request)

    def open_run(self, request: DiffusionRequest, *,
                 on_admitted: Callable[[], None] | None = None
                 ) -> tuple[AsyncGenerator[DiffusionOutput, None], Seat]:
        """``run``, with the shedding (503/429) raised here at once rather than
        on the first item: a video job is refused before it is created. The
        caller closes the outputs and then releases the seat (a no-op once the
        request reached the engine; needed when the outputs never started)."""
        engine, seat = self.engine_or_shed(on_admitted)
        return self._seated(engine, seat, request), seat

    async def _seated(self, engine: DiffusionEngine, seat: Seat, request: DiffusionRequest
                      ) -> AsyncGenerator[DiffusionOutput, None]:
        rid = request.request_id
        self._running[rid] = None
        self._in_flight += 1
        finished = False
        outputs = engine.step_streaming(request, seat=seat)
        step: asyncio.Future | None = None
        try:
            while not finished:
                step = asyncio.ensure_future(outputs.__anext__())
                while not step.done():
                    await asyncio.wait({step}, timeout=IDLE_POLL_S * 10)
                    if self._gave_up and not step.done():
                        raise ApiError(503, "the server is shutting down; the request was "
                                            "stopped", code="shutting_down")
                try:
                    out = step.result()
                except StopAsyncIteration:
                    break
                finished = out.finished
                yield out
        finally:
            try:
                if step is not None and not step.done():  # this consumer left mid-wait
                    step.cancel()
                    with contextlib.suppress(BaseException):
                        await step
                await outputs.aclose()
                if not finished:
                    engine.abort(rid)
            finally:
                seat.release()  # a request never submitted; else a no-op
                self._running.pop(rid, None)
                self._in_flight -= 1

    # -- LoRA adapters (routes: lora_routes.py) ----------------------------------------
    def running_engine(self) -> DiffusionEngine:
        """The engine, once it has started (adapters live in its workers)."""
        if self.state == "starting":
            raise ApiError(503, "the model is still loading; retry shortly",
                           code="warming_up", headers={"Retry-After": "5"})
        if self.engine is None or self.state == "failed":
            raise ApiError(503, f"the engine is down: {self.failure or 'not started'}",
                           code="engine_down")
        return self.engine

    async def list_loras(self) -> list[LoraInfo]:
        return self.running_engine().list_loras()

    async def add_lora(self, name: str, path: str) -> LoraInfo:
        """Register an adapter. ``DiffusionEngine.add_lora`` waits until every
        worker has read the file (seconds for a large one), so it runs on a
        thread: the event loop serves other requests meanwhile."""
        engine = self.running_engine()
        return await asyncio.to_thread(engine.add_lora, name, path)

    async def remove_lora(self, name: str) -> None:
        """Unregister an adapter (a call to the workers when none holds it: on a thread)."""
        engine = self.running_engine()
        await asyncio.to_thread(engine.remove_lora, name)

    def metric_snapshots(self) -> list[tuple[dict[str, str], Any]]:
        """The engine's stats for /metrics (none while it starts)."""
        return [] if self.engine is None else [({}, self.engine.stats())]

    def response_headers(self, request_id: str) -> dict[str, str]:
        """Extra headers of a request's answer (one engine here: none)."""
        return {}


async def close_all(clients: tuple[EngineClient, ...]) -> None:
    """Close every engine, each one even if closing another failed (its
    workers would be left running)."""
    for client in clients:
        try:
            await client.close()
        except Exception:
            logger.exception("closing the engine of %s failed", client.model_name)
