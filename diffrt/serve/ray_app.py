"""The images API as a Ray Serve application: engine replicas behind one endpoint.

Two deployments (``build_application``):

- ``ModelReplica``: one ``DiffusionEngine`` per replica, on the replica's own
  device(s) (``ray_actor_options`` from the engine's ranks and the
  platform's Ray resource; fractional CPUs on CPU). It streams a request's
  outputs through ``EngineClient.run``, so a call cancelled by the ingress
  aborts the request in the engine. Ray's health check calls the engine's
  ``is_healthy()``; Ray drains a replica (no new requests, those in flight
  finish, up to ``graceful_shutdown_timeout_s``) before it removes it.
  ``max_ongoing_requests`` is the engine's batch capacity (``max_num_seqs``);
  a request's stream carries ``ADMITTED`` once its engine admitted it.
- ``Ingress``: the FastAPI app of ``build_app`` (routes, errors, image URLs,
  metrics) with a ``ReplicaClient`` (``replica_client.py``) in place of the
  local engine client. One replica: it keeps the ``response_format="url"``
  images and, for a video model, the video jobs (their store, ``--video-dir``
  on the ingress's node, and their runs, which stream from the model
  replicas and encode in the ingress: any job is retrieved, listed, fetched
  and deleted through it, whichever replica made it), and holds
  ``--max-pending`` for the whole application: a seat is taken when it
  accepts a request and given back when a replica admits it or the call ends
  (``ingress_seats.py``); past the bound, 429 with Retry-After. (The handle's
  ``max_queued_requests`` is ``--max-pending`` too, a second line.)

Every model replica publishes its engine's statistics once a second to a
``StatsBoard`` actor (created by whoever deploys the application and handed
to both deployments); the ingress reads it for ``/metrics`` (every series
labelled ``replica``) and for ``/health``. Each answer names the replica that
served it in an ``x-diffrt-replica`` header. ``POST /v1/weights`` and ``PUT
/v1/loras/{name}`` reach every replica through the board too, in two phases
(``ray_weights.py``), and so do ``POST /sleep`` and ``POST /wake_up``
(``ray_sleep.py``: a replica that starts while the deployment sleeps goes
to sleep before it serves).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig
from diffrt.serve.ingress_seats import announce_admission
from diffrt.serve.ray_placement import INGRESS_CPUS, cpu_share, torch_threads_for
from diffrt.serve.ray_weight_board import WeightRounds
from diffrt.serve.ray_weights import ReplicaWeights
from diffrt.serve.replica_client import (
    PUBLISH_EVERY_S,
    REPLICA_HEADER,
    STALE_AFTER_S,
    ReplicaClient,
)
from diffrt.serve.settings import ReplicaOptions, ServeSettings

if TYPE_CHECKING:
    from diffrt.platforms.interface import Platform

logger = logging.getLogger(__name__)

#: the application's name in Ray Serve (``serve.status()``, ``serve.delete``)
APP_NAME = "diffrt"


class ReplicaSettings(ReplicaOptions, kw_only=True, frozen=True):
    """How many model replicas, and what each asks of Ray: the declared
    ``ReplicaOptions`` (``settings.py``) and the deployment made from them."""

    @property
    def initial_count(self) -> int:
        """The replicas deployed first (autoscaling: the initial count)."""
        return self.replicas or self.min_replicas

    def sized_for(self, platform: Platform, node_cpus: float) -> ReplicaSettings:
        """These settings with ``replica_cpus`` filled in: given, or on CPU the
        node's equal share for the initial replicas, else 1."""
        if self.replica_cpus is not None:
            return self
        cpus = cpu_share(node_cpus, self.initial_count) if platform.ray_resource is None else 1.0
        return msgspec.structs.replace(self, replica_cpus=cpus)

    @property
    def cpus(self) -> float:
        return 1.0 if self.replica_cpus is None else self.replica_cpus

    def deployment_options(self, config: EngineConfig, settings: ServeSettings,
                           platform: Platform) -> dict[str, Any]:
        """The model deployment's Ray Serve options."""
        from diffrt.runtime.ray_executor import rank_environment, ray_device_options

        actor: dict[str, Any] = {"num_cpus": self.cpus}
        if config.executor_backend != "ray":  # else the rank actors reserve their devices
            actor.update(ray_device_options(platform, config.ranks))
        # A replica's actor starts from the raylet's environment, not this
        # process's: the vendors' runtime settings (and allocator, thread and
        # hub settings) travel as its runtime_env, as a rank actor's do — its
        # engine's workers, or its own rank actors, inherit them from there.
        # worker_env stays with the config: the replica's engine applies it.
        env = rank_environment({})
        if env:
            actor["runtime_env"] = {"env_vars": env}
        options: dict[str, Any] = {
            "ray_actor_options": actor,
            "max_ongoing_requests": config.max_num_seqs,
            "max_queued_requests": settings.max_pending,
            "graceful_shutdown_timeout_s": settings.shutdown_timeout_s,
            "graceful_shutdown_wait_loop_s": 0.5,
            "health_check_period_s": 2.0,
            "health_check_timeout_s": 30.0,
        }
        if self.max_replicas is not None:
            options["autoscaling_config"] = {
                "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "initial_replicas": self.replicas or self.min_replicas,
                "target_ongoing_requests": (self.target_ongoing_requests
                                            or float(config.max_num_seqs)),
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s,
                "look_back_period_s": self.look_back_s,
                # deprecated in Ray 2.60 (to become environment variables) but
                # still what sets how often load is reported: within the window
                "metrics_interval_s": min(10.0, self.look_back_s / 3),
            }
        else:
            options["num_replicas"] = self.initial_count
        return options


class StatsBoard(WeightRounds):
    """The latest engine statistics of every model replica (a Ray actor), the
    weight updates' and sleep's rounds and whether the deployment sleeps
    (``WeightRounds``, ``ray_weight_board.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self._entries: dict[str, tuple[float, Any]] = {}
        self._ending = False

    def put(self, replica: str, stats: Any) -> bool:
        """Record ``replica``'s statistics; True once the drain is to end now
        (the replica then aborts its requests in flight)."""
        self._entries[replica] = (time.monotonic(), stats)
        return self._ending

    def end_drain(self) -> None:
        """A second signal during the application's drain (``diffrt serve``):
        every replica aborts its requests in flight when it next publishes."""
        self._ending = True

    def remove(self, replica: str) -> None:
        self._entries.pop(replica, None)

    def snapshot(self, max_age_s: float = STALE_AFTER_S) -> list[tuple[str, Any]]:
        """(replica, stats) of the replicas heard from within ``max_age_s``."""
        now = time.monotonic()
        for replica, (when, _) in list(self._entries.items()):
            if now - when > max_age_s:
                del self._entries[replica]
        return sorted((replica, stats) for replica, (_, stats) in self._entries.items())


class ModelReplica:
    """One engine behind the application (a Ray Serve deployment)."""

    def __init__(self, config: EngineConfig, settings: ServeSettings, board: Any,
                 cpus: float = 1.0, pin_var: str | None = None) -> None:
        # First of all: the devices Ray assigned (MUSA, which no Ray manager
        # pins; ``pin_var`` from the deploying process's platform). Resolving
        # the platform here would start the vendor runtime, which fixes the
        # visible devices (and caches their count) before the pin.
        from diffrt.runtime.ray_executor import pin_to_ray_devices

        pin_to_ray_devices(pin_var)

        from ray import serve

        from diffrt.serve.engine_client import EngineClient

        self.name = serve.get_replica_context().replica_id.unique_id
        self.board = board
        self._stop = threading.Event()
        self.engine: DiffusionEngine | None = None
        # Ray replaces a replica whose health check fails, which is this
        # engine's own restart; on CPU its threads follow the CPUs reserved
        changes: dict[str, Any] = {"restart_workers": False}
        from diffrt.platforms import current_platform

        if current_platform.device_type == "cpu" and config.torch_threads is None:
            changes["torch_threads"] = torch_threads_for(cpus, config.ranks)
        self.engine = DiffusionEngine.make_engine(config.replace(**changes))
        self.client = EngineClient(None, settings, engine=self.engine)
        #: POST /v1/weights' and /sleep's rounds, from the board (``ray_weights.py``);
        #: first the updates the others applied, and sleep if the deployment
        #: sleeps, before it serves or is counted live
        self.weights = ReplicaWeights(self.name, board, self.engine, self._stop)
        self.weights.catch_up()
        self._publisher = threading.Thread(target=self._publish, name="diffrt-stats",
                                           daemon=True)
        self._publisher.start()
        self.weights.start()

    def _publish(self) -> None:
        engine = self.engine
        assert engine is not None  # made before this thread starts
        import ray

        while not self._stop.is_set():
            try:
                ending = ray.get(self.board.put.remote(self.name, engine.stats()),
                                 timeout=PUBLISH_EVERY_S * 5)
            except Exception:  # the board may be gone while the app shuts down
                logger.debug("publishing statistics failed", exc_info=True)
                ending = False
            if ending:  # the drain ends now: what runs is answered 503 (aborted)
                aborted = self.client.abort_running()
                if aborted:
                    logger.info("the drain ends now: %d request(s) aborted", aborted)
            self._stop.wait(PUBLISH_EVERY_S)

    async def generate(self, request: DiffusionRequest) -> AsyncIterator[tuple[str, Any]]:
        """The request's outputs, each with this replica's name; ``ADMITTED``
        first, once the engine admitted the request (the ingress gives its
        seat back)."""
        loop = asyncio.get_running_loop()
        admitted = asyncio.Event()

        def on_admitted() -> None:  # on the engine loop's thread
            loop.call_soon_threadsafe(admitted.set)

        outputs = self.client.run(request, on_admitted=on_admitted)
        async for item in announce_admission(outputs, admitted):
            yield self.name, item

    def check(self, request: DiffusionRequest) -> None:
        """What this replica's engine would refuse of ``request`` at submission
        (``DiffusionEngine.check``; every replica runs the same config)."""
        assert self.engine is not None
        self.engine.check(request)

    def list_loras(self) -> list[Any]:
        """This replica's adapters (every replica registers ``lora_modules`` at start)."""
        assert self.engine is not None
        return self.engine.list_loras()

    def check_health(self) -> None:
        assert self.engine is not None  # Ray checks a replica whose __init__ returned
        if not self.engine.is_healthy():
            raise RuntimeError("the engine is not healthy")

    def pid(self) -> int:
        return os.getpid()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is None:  # construction failed early
            return
        stop.set()
        publisher = getattr(self, "_publisher", None)
        if publisher is not None:
            publisher.join(timeout=2 * PUBLISH_EVERY_S)
        try:
            self.board.remove.remote(self.name)
        except Exception:
            logger.debug("removing this replica's statistics failed", exc_info=True)
        if self.engine is not None:
            self.engine.close()


class Ingress:
    """The FastAPI app of ``build_app`` over a ``ReplicaClient`` (a Ray Serve
    ingress deployment; the app is built in the replica, after __init__)."""

    def __init__(self, model: Any, board: Any, settings: ServeSettings, model_name: str,
                 step_execution: bool) -> None:
        from ray import serve

        self.replica = serve.get_replica_context().replica_id.unique_id
        self.client = ReplicaClient(model, board, settings, model_name, step_execution)

    def __serve_build_asgi_app__(self) -> Any:
        from diffrt.serve.app import build_app

        return build_app(settings=self.client.settings, client=self.client,
                         replica=self.replica)


def ingress_cpus(replicas: ReplicaSettings) -> float:
    """CPUs the ingress reserves: 0.5, or a replica's share when that is less."""
    return min(INGRESS_CPUS, replicas.cpus)


def build_application(config: EngineConfig, settings: ServeSettings,
                      replicas: ReplicaSettings, board: Any, platform: Platform | None = None) -> Any:
    """The Ray Serve application: ``serve.run(build_application(...),
    name=APP_NAME, route_prefix="/")``. ``board`` is a ``StatsBoard`` actor
    the caller created (``ray.remote(StatsBoard).remote()``) and keeps alive."""
    from ray import serve

    from diffrt.runtime.ray_executor import ray_pinning_var

    if platform is None:
        from diffrt.platforms import current_platform
        platform = current_platform
    model = serve.deployment(name="ModelReplica")(ModelReplica).options(
        **replicas.deployment_options(config, settings, platform))
    ingress = serve.deployment(name="Ingress")(serve.ingress()(Ingress)).options(
        num_replicas=1, max_ongoing_requests=max(100, 4 * settings.max_pending),
        # outlives the replicas' drain, so answers in flight still reach their clients
        graceful_shutdown_timeout_s=settings.shutdown_timeout_s + 10,
        ray_actor_options={"num_cpus": ingress_cpus(replicas)})
    return ingress.bind(model.bind(config, settings, board, replicas.cpus,
                                   ray_pinning_var(platform)), board,
                        settings, config.model, config.step_execution)


__all__ = ["APP_NAME", "REPLICA_HEADER", "Ingress", "ModelReplica", "ReplicaClient",
           "ReplicaSettings", "StatsBoard", "build_application", "ingress_cpus"]
