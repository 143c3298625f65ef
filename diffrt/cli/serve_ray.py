"""`diffrt serve --replicas N ...`: the images API as a Ray Serve application.

Joins the cluster ``--ray-address`` names, or starts a local Ray instance
(bound to ``--host`` when that is a loopback address) and stops it at exit.
Ray Serve's HTTP proxy listens on ``--host:--port``.

Stopping, as the single-process server stops (``serve/server.py``): the
first SIGTERM or SIGINT deletes the application — Ray drains each replica
(no new requests, those in flight get ``--shutdown-timeout-s`` seconds) — and
the process exits 0; a second one ends the drain at once (``StopSignals``:
the replicas abort their requests in flight, answered 503); a third stops
waiting for Ray altogether. The handlers are installed as soon as Ray is up,
before the application deploys: a signal Ray's own handlers caught instead
(its driver's exits through ``sys.exit``, its core worker's failure handler
prints "SIGTERM received") would end the process midway, while Ray's threads
still run, and it died by SIGABRT.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from diffrt.cli.errors import EXIT_FAILURE, EXIT_USAGE
from diffrt.cli.serve_opts import replica_values
from diffrt.serve.ray_placement import PlacementError, wait_until_placed

if TYPE_CHECKING:
    from diffrt.platforms.interface import Platform


def replica_settings(args: argparse.Namespace) -> Any:
    """The ``ReplicaSettings`` of the command line (unset flags: the defaults)."""
    from diffrt.runtime.types import convert_declared
    from diffrt.serve.ray_app import ReplicaSettings

    return convert_declared(ReplicaSettings, replica_values(args))


def serve_on_ray(args: argparse.Namespace, config: Any, settings: Any) -> int:
    try:
        import ray
        from ray import serve
    except ImportError:
        from diffrt.runtime.ray_executor import RAY_EXTRA_HINT

        print(f"diffrt serve: error: --replicas (and the other Ray flags): {RAY_EXTRA_HINT}",
              file=sys.stderr)
        return EXIT_USAGE
    from diffrt.serve.ray_app import APP_NAME, StatsBoard, build_application
    from diffrt.serve.ray_patience import lengthen_proxy_checks, start_serve

    replicas = replica_settings(args)
    address = config.executor.ray_address
    local = address is None
    # "local": a new instance of our own, never a cluster $RAY_ADDRESS names
    init: dict[str, Any] = {"address": "local" if local else address,
                            "log_to_driver": False}
    if local:
        init["include_dashboard"] = False
        lengthen_proxy_checks()  # a busy machine's proxy starts slowly (ray_patience.py)
        if args.host in ("127.0.0.1", "localhost"):
            init["_node_ip_address"] = "127.0.0.1"
    ray.init(**init)
    signals = StopSignals.install()  # replaces Ray's handlers of SIGTERM and SIGINT
    started = deployed = False
    board: Any = None
    try:
        from diffrt.platforms import current_platform

        try:  # what the cluster cannot hold is refused before anything is deployed
            replicas = check_placement(replicas, config, settings, current_platform,
                                       ray.cluster_resources())
        except PlacementError as exc:
            print(f"diffrt serve: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        start_serve(serve, {"host": args.host, "port": args.port})
        started = True
        board = ray.remote(StatsBoard).options(num_cpus=0).remote()
        print(f"diffrt serve: deploying {config.model} on Ray ({_describe(replicas)})",
              file=sys.stderr, flush=True)
        deployed = True  # from here a failure leaves something to delete
        # submitted without waiting (the controller deploys it): the watchdog
        # below follows it, and a signal meanwhile finds no thread inside Ray
        serve.run_many([serve.RunTarget(build_application(config, settings, replicas, board),
                                        name=APP_NAME, route_prefix="/")],
                       wait_for_ingress_deployment_creation=False,
                       wait_for_applications_running=False)
        try:
            wait_until_placed(lambda: _app_status(serve), args.placement_timeout_s,
                              sleep=signals.sleep)
        except PlacementError as exc:
            print(f"diffrt serve: error: {exc}", file=sys.stderr)
            # a deployment that failed is a failure; one Ray could not place, a usage error
            return EXIT_FAILURE if _app_status(serve)[0] == "DEPLOY_FAILED" else EXIT_USAGE
        except StopRequested:  # stopped while deploying: what is up drains as below
            return 0
        print(f"diffrt serve: {config.model} ready at http://{args.host}:{args.port} "
              f"({config.mode.value} mode, {_describe(replicas)} on Ray)", flush=True)
        signals.first.wait()
        return 0
    finally:
        if deployed:
            print("diffrt serve: draining the replicas", file=sys.stderr, flush=True)
            # the ingress outlives the replicas' drain by 10 s (ray_app.build_application)
            delete_app(serve, APP_NAME, board, signals, settings.shutdown_timeout_s + 30)
        if local and started:
            serve.shutdown()
        ray.shutdown()


class StopRequested(Exception):
    """A signal came while the application was still deploying."""


class StopSignals:
    """SIGTERM and SIGINT, counted: the first asks for a drain (``first``),
    the second to end it now (``second``), the third to stop waiting for Ray
    (``third``). Handlers only set events; the main thread acts on them."""

    def __init__(self) -> None:
        self.count = 0
        self.first, self.second, self.third = (threading.Event() for _ in range(3))

    @classmethod
    def install(cls) -> StopSignals:
        signals = cls()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signals.handle)
        return signals

    def handle(self, sig: int, frame: Any) -> None:
        self.count += 1
        events = (self.first, self.second, self.third)
        events[min(self.count, len(events)) - 1].set()

    def sleep(self, seconds: float) -> None:
        """``time.sleep`` for a wait that a signal cuts short (StopRequested)."""
        if self.first.wait(seconds):
            raise StopRequested


#: how often the drain looks whether Ray has removed the application
DELETE_POLL_S = 0.25


def delete_app(serve: Any, name: str, board: Any, signals: StopSignals,
               give_up_s: float) -> None:
    """Delete the application and wait until Ray has removed it (Ray drains
    each replica first, up to its ``graceful_shutdown_timeout_s``). A second
    signal tells the replicas, through the statistics board, to abort their
    requests in flight (answered 503); a third, or ``give_up_s``, stops
    waiting (``serve.shutdown`` then stops what is left)."""
    import time

    serve.delete(name, _blocking=False)
    told = False
    give_up_at = time.monotonic() + give_up_s
    while not _app_gone(serve, name):
        if signals.third.is_set() or time.monotonic() > give_up_at:
            print("diffrt serve: not waiting for the drain any longer", file=sys.stderr,
                  flush=True)
            return
        if signals.second.is_set() and not told and board is not None:
            print("diffrt serve: ending the drain now", file=sys.stderr, flush=True)
            board.end_drain.remote()
            told = True
        signals.third.wait(DELETE_POLL_S)


def _app_gone(serve: Any, name: str) -> bool:
    app = serve.status().applications.get(name)
    return app is None or str(getattr(app.status, "value", app.status)) == "NOT_STARTED"


def check_placement(replicas: Any, config: Any, settings: Any, platform: Platform,
                    cluster: dict[str, float]) -> Any:
    """``replicas`` sized for this cluster (CPU replicas: an equal share of its
    CPUs), or PlacementError naming what the deployment asks beyond what the
    cluster has (the initial replicas and the ingress)."""
    from diffrt.serve.ray_app import ingress_cpus
    from diffrt.serve.ray_placement import check_fits, demand

    sized = replicas.sized_for(platform, cluster.get("CPU", 0.0))
    actor = sized.deployment_options(config, settings, platform)["ray_actor_options"]
    need = demand(actor, sized.initial_count, ingress_cpus(sized))
    check_fits(need, cluster, f"{_describe(sized)} (each {_resources(actor)}) and the ingress")
    return sized


def _resources(actor: dict[str, Any]) -> str:
    parts = [f"CPU {actor.get('num_cpus', 1):g}"]
    if actor.get("num_gpus"):
        parts.append(f"GPU {actor['num_gpus']:g}")
    parts += [f"{k} {v:g}" for k, v in (actor.get("resources") or {}).items()]
    return ", ".join(parts)


def _app_status(serve: Any) -> tuple[str, str]:
    """(state, message) of the application for the placement watchdog."""
    from diffrt.serve.ray_app import APP_NAME

    app = serve.status().applications.get(APP_NAME)
    if app is None:
        return "NOT_STARTED", ""
    state = str(getattr(app.status, "value", app.status))
    messages = [app.message, *(f"{name}: {d.message}" for name, d in app.deployments.items()
                               if d.message)]
    return state, "; ".join(m for m in messages if m)


def _describe(replicas: Any) -> str:
    if replicas.max_replicas is not None:
        return f"{replicas.min_replicas} to {replicas.max_replicas} replicas, autoscaling"
    count = replicas.replicas or 1
    return f"{count} replica{'s' if count != 1 else ''}"
