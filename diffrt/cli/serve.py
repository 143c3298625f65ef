"""`diffrt serve`: the OpenAI-compatible images API over one engine (or, with
``--replicas`` and the other Ray flags, over engine replicas on Ray Serve:
``serve_ray.py``).

The engine starts in the background: /health and /ready answer while the
model loads, and the URL is printed once it is warm. The first SIGTERM or
SIGINT drains (``/ready`` 503, new requests 503, requests in flight get up to
``--shutdown-timeout`` seconds, the rest are aborted with an error), then the
server stops, the workers exit and the process exits 0; a second signal stops
at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from diffrt.cli.engine_opts import (
    UNSET,
    add_engine_args,
    engine_settings,
    model_name,
    model_spec,
    non_negative_float,
    plugin_modules,
    positive_float,
    positive_int,
)
from diffrt.cli.errors import EXIT_FAILURE

#: serve's own defaults for engine settings (shown in --help): STEP_BATCH
#: with room for eight requests per step, a bound on unread outputs (a client
#: that stops reading its stream must not hold its image in the shared arena
#: for ever) and fresh workers after a crash
SERVE_DEFAULTS = {"step_execution": True, "max_num_seqs": 8, "unread_output_timeout_s": 120.0,
                  "restart_workers": True}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model over HTTP (OpenAI images API)",
        description="Serve a model over HTTP: POST /v1/images/generations (OpenAI's Images "
                    "API, streamed previews with stream=true), GET /v1/models, /health, "
                    "/ready, /metrics.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("DIFFRT_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: "
                        "$DIFFRT_API_KEY; unset: no key)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: --model)")
    p.add_argument("--max-pending", type=positive_int, default=64,
                   help="answer 429 when more requests than this wait to run "
                        "(default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=non_negative_float, default=30.0,
                   help="seconds requests in flight may take after SIGTERM (default: "
                        "%(default)s)")
    p.add_argument("--max-body-bytes", type=positive_int, default=1 << 20,
                   help="largest request body (default: %(default)s)")
    p.add_argument("--url-ttl", type=non_negative_float, default=600.0,
                   help='seconds a response_format="url" image is kept (default: %(default)s)')
    ray = p.add_argument_group(
        "replicas on Ray Serve (the ray extra; docs/scale-out.md)",
        "Any of these serves the same API as a Ray Serve application: an ingress and "
        "model replicas, each owning one engine on its own device(s).")
    ray.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                     help="model replicas (with autoscaling: the initial count)")
    ray.add_argument("--min-replicas", type=positive_int, default=None, metavar="N",
                     help="autoscaling: the fewest replicas (default 1)")
    ray.add_argument("--max-replicas", type=positive_int, default=None, metavar="N",
                     help="autoscaling: the most replicas (turns autoscaling on)")
    ray.add_argument("--target-ongoing-requests", type=positive_float, default=None,
                     metavar="R", help="autoscaling: requests per replica to aim for "
                                       "(default: --max-num-seqs)")
    ray.add_argument("--upscale-delay", type=non_negative_float, default=None, metavar="S",
                     help="autoscaling: seconds above target before a replica is added "
                          "(default 30)")
    ray.add_argument("--downscale-delay", type=non_negative_float, default=None, metavar="S",
                     help="autoscaling: seconds below target before one is removed "
                          "(default 600)")
    ray.add_argument("--replica-cpus", type=positive_float, default=None, metavar="C",
                     help="CPUs each replica reserves in Ray (fractions allowed; default 1)")
    add_engine_args(p, defaults=SERVE_DEFAULTS)
    p.set_defaults(func=run)


#: the flags that put the server on Ray Serve
RAY_FLAGS = ("replicas", "min_replicas", "max_replicas", "target_ongoing_requests",
             "upscale_delay", "downscale_delay", "replica_cpus", "ray_address")


def on_ray(args: argparse.Namespace) -> bool:
    """Any Ray flag given (--ray-address is the engine's setting, which also
    says which cluster Ray Serve joins)."""
    return any(getattr(args, flag, None) not in (None, UNSET) for flag in RAY_FLAGS)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from diffrt.engine import EngineConfig
    from diffrt.serve import ServeSettings, build_app
    from diffrt.serve.server import DrainingServer

    # the access log (one line per request) and the drain are the server's output
    serve_logger = logging.getLogger("diffrt.serve")
    serve_logger.setLevel(min(logging.INFO, serve_logger.getEffectiveLevel()))
    model_spec(model_name(args), plugin_modules(args))  # a bad model is refused first
    config = EngineConfig(**engine_settings(args))
    serve_settings = ServeSettings(
        model_name=args.served_model_name, api_key=args.api_key or None,
        max_pending=args.max_pending, shutdown_timeout_s=args.shutdown_timeout,
        max_body_bytes=args.max_body_bytes, url_ttl_s=args.url_ttl)
    if on_ray(args):
        from diffrt.cli.serve_ray import serve_on_ray

        return serve_on_ray(args, config, serve_settings)
    failure: list[str] = []
    server = None

    def on_ready() -> None:
        port = (server.bound_port() if server is not None else None) or args.port
        print(f"diffrt serve: {config.model} ready at http://{args.host}:{port} "
              f"({config.mode.value} mode)", flush=True)

    def on_failed(reason: str) -> None:
        failure.append(reason)
        print(f"diffrt serve: error: the engine could not start: {reason}", file=sys.stderr,
              flush=True)
        assert server is not None
        server.should_exit = True

    app = build_app(config, serve_settings, on_ready=on_ready, on_failed=on_failed)
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None,
                               access_log=False, timeout_graceful_shutdown=5,
                               lifespan="on")
    server = DrainingServer(uv_config, app.state.client, args.shutdown_timeout)
    print(f"diffrt serve: loading {config.model}; http://{args.host}:{args.port}/ready "
          "turns 200 when it is warm", file=sys.stderr, flush=True)
    server.run()
    return EXIT_FAILURE if failure else 0
