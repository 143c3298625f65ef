"""`diffrt serve`: the OpenAI-compatible images API over one engine (or, with
``--replicas`` and the other Ray flags, over engine replicas on Ray Serve:
``serve_ray.py``).

The engine starts in the background: /health and /ready answer while the
model loads, and the URL is printed once it is warm. The first SIGTERM or
SIGINT drains (``/ready`` 503, new requests 503, requests in flight get up to
``--shutdown-timeout-s`` seconds, the rest are aborted with an error), then the
server stops, the workers exit and the process exits 0; a second signal stops
at once.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from diffrt.cli.engine_opts import (
    add_engine_args,
    engine_settings,
    model_name,
    model_spec,
    plugin_modules,
)
from diffrt.cli.errors import EXIT_FAILURE
from diffrt.cli.profiles import SERVE
from diffrt.cli.serve_opts import (
    add_serve_args,
    build_serve_settings,
    http_limits,
    on_ray,
    replica_values,
    serve_command,
)

__all__ = ["add_parser", "build_serve_settings", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model over HTTP (OpenAI images API)",
        description="Serve a model over HTTP: POST /v1/images/generations (OpenAI's Images "
                    "API, streamed previews with stream=true), GET /v1/models, "
                    "GET/POST/DELETE /v1/loras, /health, /ready, /metrics.")
    add_serve_args(p)
    add_engine_args(p, profile=SERVE)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from diffrt.cli import listen

    # the flags first, then the address (bound now: a bad or busy one is one
    # line before anything loads), then the model
    serve_command(args)  # its declared bounds
    replica_values(args)  # autoscaling flags need --max-replicas
    settings_for_serve = build_serve_settings(args)
    limits = http_limits(args)
    if on_ray(args):  # Ray Serve's proxy binds it: only checked here
        listen.bind(args.host, args.port).close()
        sock = None
    else:
        sock = listen.bind(args.host, args.port)
    try:
        return _run(args, settings_for_serve, limits, sock)
    finally:
        if sock is not None:
            sock.close()


def _run(args: argparse.Namespace, serve_settings: Any, limits: Any, sock: Any) -> int:
    from diffrt.engine import EngineConfig
    from diffrt.serve import build_app
    from diffrt.serve.server import DrainingServer, uvicorn_config

    # the access log (one line per request) and the drain are the server's output
    serve_logger = logging.getLogger("diffrt.serve")
    serve_logger.setLevel(min(logging.INFO, serve_logger.getEffectiveLevel()))
    model_spec(model_name(args), plugin_modules(args))  # a bad model is refused first
    config = EngineConfig(**engine_settings(args))
    config.model_spec()  # what the model refuses exits 2 here, before an engine starts
    if on_ray(args):
        from diffrt.cli.serve_ray import serve_on_ray

        return serve_on_ray(args, config, serve_settings)
    failure: list[str] = []
    server = None

    def on_ready() -> None:
        port = (server.bound_port() if server is not None else None) or args.port
        print(f"diffrt serve: {served(('ready',))} ready at http://{args.host}:{port} "
              f"({config.mode.value} mode)", flush=True)

    def on_failed(reason: str) -> None:
        failure.append(reason)
        print(f"diffrt serve: error: the engine could not start: {reason}", file=sys.stderr,
              flush=True)
        assert server is not None
        server.should_exit = True

    app = build_app(config, serve_settings, on_ready=on_ready, on_failed=on_failed)

    def served(states: tuple[str, ...]) -> str:
        """The default model's server: "diffrt-shapes (and diffrt-motion for
        /v1/videos)", the video engine named while in one of ``states``."""
        return config.model + "".join(f" (and {c.config.model} for /v1/videos)"
                                      for c in app.state.clients[1:] if c.state in states)

    server = DrainingServer(uvicorn_config(app, limits, host=args.host, port=args.port),
                            app.state.clients, serve_settings.shutdown_timeout_s)
    print(f"diffrt serve: loading {served(('starting',))}; http://{args.host}:{args.port}/ready "
          "turns 200 when it is warm", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    return EXIT_FAILURE if failure else 0
