"""`diffrt serve`: the OpenAI-compatible images API over one engine.

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
    add_engine_args,
    engine_settings,
    non_negative_float,
    pipeline_class,
    positive_int,
)
from diffrt.cli.errors import EXIT_FAILURE

#: serve's default for --unread-output-timeout (the engine's is None)
SERVE_UNREAD_OUTPUT_TIMEOUT_S = 120.0

#: serve's default for --unread-output-timeout (the engine's is None)
SERVE_UNREAD_OUTPUT_TIMEOUT_S = 120.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model over HTTP (OpenAI images API)",
        description="Serve a model over HTTP: POST /v1/images/generations (OpenAI's Images "
                    "API, streamed previews with stream=true), GET /v1/models, /health, "
                    "/ready, /metrics.")
    p.add_argument("--model", "-m", default="tiny-flux",
                   help="embedded model name (tiny-flux, tiny-sd3), a local diffusers folder, "
                        "or a hub id in the local Hugging Face cache (default: %(default)s)")
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
    p.add_argument("--no-restart", dest="restart_workers", action="store_false",
                   help="do not replace workers that died or hung (by default fresh ones "
                        "are started and /health turns 200 again)")
    add_engine_args(p, executor=None, mode="step")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from diffrt.engine import EngineConfig
    from diffrt.serve import ServeSettings, build_app
    from diffrt.serve.server import DrainingServer

    # the access log (one line per request) and the drain are the server's output
    serve_logger = logging.getLogger("diffrt.serve")
    serve_logger.setLevel(min(logging.INFO, serve_logger.getEffectiveLevel()))
    pipeline_class(args.model, args.plugin_module)  # a bad model is refused before anything starts
    settings = engine_settings(args)
    if args.max_num_seqs is None:
        settings["max_num_seqs"] = 8
    # a client that stops reading its stream must not hold its image in shared
    # memory for ever: the arena is shared by every request
    settings.setdefault("unread_output_timeout_s", SERVE_UNREAD_OUTPUT_TIMEOUT_S)
    settings["restart_workers"] = args.restart_workers
    config = EngineConfig(**settings)
    serve_settings = ServeSettings(
        model_name=args.served_model_name, api_key=args.api_key or None,
        max_pending=args.max_pending, shutdown_timeout_s=args.shutdown_timeout,
        max_body_bytes=args.max_body_bytes, url_ttl_s=args.url_ttl)
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
