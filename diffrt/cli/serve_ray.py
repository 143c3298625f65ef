"""`diffrt serve --replicas N ...`: the images API as a Ray Serve application.

Joins the cluster ``--ray-address`` names, or starts a local Ray instance
(bound to ``--host`` when that is a loopback address) and stops it at exit.
Ray Serve's HTTP proxy listens on ``--host:--port``. The first SIGTERM or
SIGINT deletes the application — Ray drains each replica (no new requests,
those in flight get ``--shutdown-timeout-s`` seconds) — and the process exits 0.
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

    replicas = replica_settings(args)
    address = config.executor.ray_address
    local = address is None
    # "local": a new instance of our own, never a cluster $RAY_ADDRESS names
    init: dict[str, Any] = {"address": "local" if local else address,
                            "log_to_driver": False}
    if local:
        init["include_dashboard"] = False
        if args.host in ("127.0.0.1", "localhost"):
            init["_node_ip_address"] = "127.0.0.1"
    ray.init(**init)
    started = deployed = False
    try:
        from diffrt.platforms import current_platform

        try:  # what the cluster cannot hold is refused before anything is deployed
            replicas = check_placement(replicas, config, settings, current_platform,
                                       ray.cluster_resources())
        except PlacementError as exc:
            print(f"diffrt serve: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        serve.start(http_options={"host": args.host, "port": args.port})
        started = True
        board = ray.remote(StatsBoard).options(num_cpus=0).remote()
        print(f"diffrt serve: deploying {config.model} on Ray ({_describe(replicas)})",
              file=sys.stderr, flush=True)
        deployed = True  # from here a failure leaves something to delete
        failed: list[BaseException] = []

        def deploy() -> None:
            try:
                serve.run(build_application(config, settings, replicas, board), name=APP_NAME,
                          route_prefix="/")
            except BaseException as exc:  # reported by the watchdog below
                failed.append(exc)

        threading.Thread(target=deploy, name="diffrt-deploy", daemon=True).start()
        try:
            wait_until_placed(lambda: _app_status(serve, failed), args.placement_timeout_s)
        except PlacementError as exc:
            print(f"diffrt serve: error: {exc}", file=sys.stderr)
            return EXIT_USAGE if not failed else EXIT_FAILURE
        stop = threading.Event()  # the first signal drains; Ctrl-C before this interrupts
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(f"diffrt serve: {config.model} ready at http://{args.host}:{args.port} "
              f"({config.mode.value} mode, {_describe(replicas)} on Ray)", flush=True)
        stop.wait()
        print("diffrt serve: draining the replicas", file=sys.stderr, flush=True)
        return 0
    finally:
        if deployed:
            serve.delete(APP_NAME)  # Ray drains the replicas first
        if local and started:
            serve.shutdown()
        ray.shutdown()


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


def _app_status(serve: Any, failed: list[BaseException]) -> tuple[str, str]:
    """(state, message) of the application for the placement watchdog."""
    if failed:
        exc = failed[0]
        return "DEPLOY_FAILED", f"{type(exc).__name__}: {exc}"
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
