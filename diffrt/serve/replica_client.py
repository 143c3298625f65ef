"""The Ray ingress's engine client: the interface of ``EngineClient``
(``engine_client.py``), answered by the model replicas (``ray_app.py``)
through a Ray Serve handle.

A request's outputs stream from whichever replica Ray's router picks;
leaving early cancels the call, which aborts the request there. The
ingress holds ``--max-pending`` over every replica (``ingress_seats.py``).
The replicas' statistics come from the ``StatsBoard`` actor they publish to
(for ``/metrics`` and ``/health``), and so does whether the deployment
sleeps (``ray_sleep.py``: ``POST /sleep`` and ``POST /wake_up`` reach every
replica through the board's rounds). A video job's run goes through
``open_run`` like any request: its job lives in the ingress's store
(``app.state.videos``), so every replica's work is listed, fetched and
deleted through the one ingress (docs/scale-out.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

from diffrt.engine import DiffusionOutput, DiffusionRequest
from diffrt.serve.engine_client import sleeping_refusal
from diffrt.serve.errors import ApiError
from diffrt.serve.ingress_seats import IngressSeat, WaitingSeats, is_admitted
from diffrt.serve.settings import ServeSettings

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-diffrt-replica"
#: how often a replica publishes its statistics, and when they count as gone
PUBLISH_EVERY_S = 1.0
STALE_AFTER_S = 10.0


class ReplicaClient:
    """The ingress's engine client: the same interface as ``EngineClient``,
    answered by the model replicas through a Ray Serve handle."""

    #: each replica has an engine of its own, and a handle reaches one of
    #: them (and not those autoscaling adds later): adapters are registered
    #: at start (``lora_modules``) only, and POST/DELETE /v1/loras answer 501;
    #: updates go to every replica (``update_weights``, ``update_lora``)
    runtime_loras = False

    def __init__(self, model: Any, board: Any, settings: ServeSettings, model_name: str,
                 step_execution: bool) -> None:
        self.model = model
        self.board = board
        self.settings = settings
        self.model_name = settings.model_name or model_name
        self.step_execution = step_execution
        self._model = model_name
        # ready from the start: Ray deploys the ingress once the model replicas
        # passed their health checks (and may route to it before the app's
        # lifespan has run)
        self.state = "ready"
        self.failure: str | None = None
        self._in_flight = 0
        #: max_pending over every replica: requests accepted, not yet admitted
        self.seats = WaitingSeats(settings.max_pending)
        #: request id -> the replica that answered it, until the route reads it
        #: (bounded: the answers of failed requests are never read)
        self._served_by: OrderedDict[str, str] = OrderedDict()
        self._snapshots: list[tuple[str, Any]] = []
        self._heard_from_replicas = False
        #: the level the deployment sleeps at (the board's ``sleep_level``), or None
        self._sleep_level: int | None = None
        self._watch: asyncio.Task | None = None
        self._updating = asyncio.Lock()

    # -- lifecycle (the app's lifespan) ---------------------------------------------
    async def start(self) -> None:
        """Start reading the statistics board (also done by the first request)."""
        if self._watch is None:
            self._watch = asyncio.create_task(self._read_board())

    async def _read_board(self) -> None:
        while True:
            await self.read_board_once()
            await asyncio.sleep(PUBLISH_EVERY_S)

    async def read_board_once(self) -> None:
        """Read the replicas' statistics and whether the deployment sleeps."""
        try:
            self._snapshots = await self.board.snapshot.remote()
            self._heard_from_replicas |= bool(self._snapshots)
            if not self._updating.locked():  # a round's answer sets it meanwhile
                self._sleep_level = await self.board.sleep_level.remote()
        except Exception:  # no board: nothing known about the replicas
            logger.debug("reading the statistics board failed", exc_info=True)
            self._snapshots = []

    async def drain(self, timeout_s: float) -> None:
        """Refuse new work; give requests in flight ``timeout_s`` to finish
        (the handler of one still running then answers when its replica does)."""
        if self.state in ("draining", "stopped"):
            return
        self.state = "draining"
        give_up_at = time.monotonic() + timeout_s
        while self._in_flight and time.monotonic() < give_up_at:
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        self.state = "stopped"
        if self._watch is not None:
            self._watch.cancel()

    def model_spec(self) -> Any:
        """The model's description when this node can read its folder (the
        replicas' node may hold a folder the ingress's does not)."""
        from diffrt.engine.models.registry import resolve_model_spec

        try:
            return resolve_model_spec(self._model)
        except (ValueError, OSError):
            return None

    def healthy(self) -> bool:
        """Some replica's engine reported itself healthy within the last
        ``STALE_AFTER_S`` (before the first report: assumed, since Ray deploys
        the ingress once the replicas passed their health checks)."""
        if not self._heard_from_replicas:
            return True
        return any(stats.healthy for _, stats in self._snapshots)

    def stall(self) -> str | None:
        """Why no replica makes progress, when every healthy one reported a
        stall (``DiffusionEngine.stall``); else None."""
        live = [stats for _, stats in self._snapshots if stats.healthy]
        stalls = [getattr(stats, "stall", None) for stats in live]
        if live and all(stalls):
            return stalls[0]
        return None

    def ready(self) -> bool:
        return self.state == "ready" and self.healthy() and self.stall() is None

    def sleeping(self) -> bool:
        """The deployment sleeps (``POST /sleep``, until ``POST /wake_up``)."""
        return self._sleep_level is not None

    # -- requests -----------------------------------------------------------------------
    async def run(self, request: DiffusionRequest) -> AsyncIterator[DiffusionOutput]:
        """The request's outputs from whichever replica Ray picks; leaving
        early cancels the call, which aborts the request in that replica."""
        outputs, _ = self.open_run(request)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()

    def open_run(self, request: DiffusionRequest
                 ) -> tuple[AsyncGenerator[DiffusionOutput, None], IngressSeat]:
        """``run``, with the shedding (503/429) raised here at once, as
        ``EngineClient.open_run``: a video job is refused before it exists.
        The caller closes the outputs, then releases the seat (needed when
        the outputs never started)."""
        if self.state != "ready":
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        if self.sleeping() and self.settings.sleep_requests == "refuse":
            raise sleeping_refusal(self.settings)  # "wait": in the replica's engine
        seat = self.seats.take()
        if seat is None:
            raise ApiError(429, f"{self.seats.limit} requests are waiting (max_pending="
                                f"{self.settings.max_pending}); retry later",
                           code="rate_limit_exceeded",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        return self._stream(request, seat), seat

    async def check(self, request: DiffusionRequest) -> None:
        """What a replica's engine would refuse of ``request`` at submission
        (``InvalidRequestError``), asked of one replica, submitting nothing."""
        from ray.exceptions import RayActorError, RayTaskError
        from ray.serve.exceptions import DeploymentUnavailableError

        try:
            await self.model.check.remote(request)
        except (RayActorError, DeploymentUnavailableError) as exc:
            raise ApiError(503, f"no replica answered ({type(exc).__name__})",
                           code="engine_down") from None
        except RayTaskError as exc:  # the refusal, raised in the replica
            raise exc.as_instanceof_cause() from None

    async def _stream(self, request: DiffusionRequest, seat: IngressSeat
                      ) -> AsyncGenerator[DiffusionOutput, None]:
        from ray.exceptions import RayActorError, RayTaskError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

        self._in_flight += 1
        finished = False
        stream = None
        try:
            await self.start()
            stream = self.model.options(stream=True).generate.remote(request)
            async for replica, out in stream:
                if is_admitted(out):  # the replica's engine runs it: the seat is free
                    seat.release()
                    continue
                if not self._served_by.get(out.request_id):
                    self._served_by[out.request_id] = replica
                    while len(self._served_by) > 4096:
                        self._served_by.popitem(last=False)
                finished = out.finished
                yield out
        except BackPressureError:
            raise ApiError(429, f"every replica is busy and {self.settings.max_pending} "
                                "requests wait (max_pending); retry later",
                           code="rate_limit_exceeded",
                           headers={"Retry-After": str(self.settings.retry_after_s)}) from None
        except (RayActorError, DeploymentUnavailableError) as exc:
            raise ApiError(503, f"the replica serving the request died ({type(exc).__name__})",
                           code="engine_down") from None
        except RayTaskError as exc:  # an error of ours, raised in the replica
            cause = exc.as_instanceof_cause()
            raise cause from None
        finally:
            if stream is not None and not finished:
                try:  # a call that already failed re-raises its error here
                    stream.cancel()
                except Exception:
                    logger.debug("cancelling the replica call failed", exc_info=True)
            seat.release()
            self._in_flight -= 1

    async def list_loras(self) -> list[Any]:
        """The adapters of one replica, which Ray picks (all register the same
        ``lora_modules`` at start; ``requests``, ``active`` and ``slot`` are that
        replica's)."""
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import DeploymentUnavailableError

        try:
            return await self.model.list_loras.remote()
        except (RayActorError, DeploymentUnavailableError) as exc:
            raise ApiError(503, f"no replica answered ({type(exc).__name__})",
                           code="engine_down") from None

    async def update_weights(self, source: str | Mapping[str, Any], *, version: Any,
                             policy: str, param: str) -> Any:
        """``POST /v1/weights`` on every live replica, all or none
        (``ray_weights.py``); one update at a time."""
        from diffrt.serve.ray_weights import update_everywhere

        async with self._updating:
            return await update_everywhere(self.board, source, version, policy, param)

    async def update_lora(self, name: str, source: str | Mapping[str, Any], *, version: Any,
                          param: str) -> Any:
        """``PUT /v1/loras/{name}`` on every live replica, as ``update_weights``."""
        from diffrt.serve.ray_weights import update_lora_everywhere

        async with self._updating:
            return await update_lora_everywhere(self.board, name, source, version, param)

    async def sleep(self, level: int) -> dict[str, Any]:
        """``POST /sleep`` on every live replica (``ray_sleep.py``); one round
        at a time, weight updates' included."""
        from diffrt.serve.ray_sleep import sleep_everywhere

        async with self._updating:
            self._sleep_level = level  # the board says so too, from now on
            try:
                return await sleep_everywhere(self.board, level)
            finally:
                self._sleep_level = await self.board.sleep_level.remote()

    async def wake(self) -> dict[str, Any]:
        """``POST /wake_up`` on every live replica, as ``sleep``."""
        from diffrt.serve.ray_sleep import wake_everywhere

        async with self._updating:
            self._sleep_level = None
            try:
                return await wake_everywhere(self.board)
            finally:
                self._sleep_level = await self.board.sleep_level.remote()

    async def add_lora(self, name: str, path: str) -> Any:
        raise ApiError(501, "adapters are registered at start on Ray Serve (--lora-modules)",
                       code="not_implemented")

    async def remove_lora(self, name: str) -> None:
        raise ApiError(501, "adapters are registered at start on Ray Serve (--lora-modules)",
                       code="not_implemented")

    def metric_snapshots(self) -> list[tuple[dict[str, str], Any]]:
        return [({"replica": replica}, stats) for replica, stats in self._snapshots]

    def response_headers(self, request_id: str) -> dict[str, str]:
        replica = self._served_by.pop(request_id, None)
        return {} if replica is None else {REPLICA_HEADER: replica}


__all__ = ["PUBLISH_EVERY_S", "REPLICA_HEADER", "STALE_AFTER_S", "ReplicaClient"]
