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
from typing import Any

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
from diffrt.cli.errors import EXIT_FAILURE, CliError

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
                    "API, streamed previews with stream=true), GET /v1/models, "
                    "GET/POST/DELETE /v1/loras, /health, /ready, /metrics.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000,
                   help="port, 0-65535 (0: a free one; default: %(default)s)")
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
    p.add_argument("--max-edit-body-bytes", type=positive_int, default=32 << 20,
                   help="largest body of POST /v1/images/edits, its images and mask together "
                        "(default: %(default)s)")
    p.add_argument("--max-edit-bytes-in-flight", type=positive_int, default=256 << 20,
                   help="bytes of edit bodies held at once (being received or decoded); an "
                        "edit past it: 429 (default: %(default)s)")
    p.add_argument("--url-ttl", type=non_negative_float, default=600.0,
                   help='seconds a response_format="url" image is kept (default: %(default)s)')
    p.add_argument("--client-priority-floor", type=priority, default=None, metavar="N",
                   help="refuse (400) HTTP requests whose priority is below N (-10..10), so "
                        "clients cannot claim the most urgent classes; a request naming none "
                        "gets max(0, N) (default: any priority)")
    p.add_argument("--lora-dir", default=None, metavar="DIR",
                   help="allow POST /v1/loras to register LoRA adapters whose real path "
                        "(symlinks resolved) lies inside DIR (default: off, 403; adapters "
                        "given with --lora-modules need none)")
    edge = p.add_argument_group(
        "the HTTP edge (docs/limits.md#http)",
        "Bounds on what one client may hold, each checked before a request reaches the "
        "engine.")
    edge.add_argument("--allowed-hosts", default=None, metavar="H[,H...]",
                      help="Host header names answered, '*.example.com' patterns allowed, "
                           "'*' any (default: the bound address, plus localhost when it is "
                           "a loopback address; any host when bound to 0.0.0.0 or ::)")
    edge.add_argument("--public-url", default=None, metavar="URL",
                      help='base of response_format="url" image URLs, e.g. '
                           "https://images.example.com (default: relative URLs)")
    edge.add_argument("--max-header-bytes", type=positive_int, default=16 << 10,
                      help="request line and headers together; larger: 400 (default: "
                           "%(default)s)")
    edge.add_argument("--max-request-line-bytes", type=positive_int, default=8 << 10,
                      help="request target (path and query); longer: 414 (default: "
                           "%(default)s)")
    edge.add_argument("--header-timeout", type=positive_float, default=10.0,
                      help="seconds from a connection's opening (or its next request's "
                           "first byte) to the end of the headers; then it is closed "
                           "(default: %(default)s)")
    edge.add_argument("--body-timeout", type=positive_float, default=30.0,
                      help="seconds to receive a whole request body; then 408 (default: "
                           "%(default)s)")
    edge.add_argument("--keep-alive-timeout", type=positive_float, default=5.0,
                      help="seconds an idle kept-alive connection stays open (default: "
                           "%(default)s)")
    edge.add_argument("--limit-concurrency", type=positive_int, default=512,
                      help="connections (and requests in progress) beyond this get 503 at "
                           "once (default: %(default)s)")
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
                     help="CPUs each replica reserves in Ray (fractions allowed; default: on "
                          "CPU an equal share of the node, (CPUs - 0.5) / replicas; else 1)")
    ray.add_argument("--placement-timeout", type=positive_float, default=60.0, metavar="S",
                     help="seconds the application may take to be placed and start before "
                          "the server gives up naming what Ray reported (default: "
                          "%(default)s)")
    add_engine_args(p, defaults=SERVE_DEFAULTS)
    p.set_defaults(func=run)


#: the flags that put the server on Ray Serve
RAY_FLAGS = ("replicas", "min_replicas", "max_replicas", "target_ongoing_requests",
             "upscale_delay", "downscale_delay", "replica_cpus", "ray_address")


def on_ray(args: argparse.Namespace) -> bool:
    """Any Ray flag given (--ray-address is the engine's setting, which also
    says which cluster Ray Serve joins)."""
    return any(getattr(args, flag, None) not in (None, UNSET) for flag in RAY_FLAGS)


def allowed_hosts(args: argparse.Namespace) -> tuple[str, ...] | None:
    """``--allowed-hosts`` as a tuple (None: any host), or its default for ``--host``."""
    from diffrt.serve.guards import default_allowed_hosts

    if args.allowed_hosts is None:
        return default_allowed_hosts(args.host)
    hosts = tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip())
    for host in hosts:
        if "*" in host[1:] or (host.startswith("*") and host != "*"
                               and not host.startswith("*.")):
            raise CliError(f"--allowed-hosts: {host!r}: a pattern is '*' or '*.example.com'")
    if not hosts:
        raise CliError("--allowed-hosts: give at least one host name (or '*' for any)")
    return None if "*" in hosts else hosts


def public_url(args: argparse.Namespace) -> str | None:
    from urllib.parse import urlsplit

    if args.public_url is None:
        return None
    parts = urlsplit(args.public_url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query:
        raise CliError(f"--public-url {args.public_url!r}: must be an http(s) URL such as "
                       "https://images.example.com (a path prefix allowed, no query)")
    return args.public_url.rstrip("/")


def lora_dir(args: argparse.Namespace) -> str | None:
    """``--lora-dir`` as its real path: an existing folder, one engine (Ray
    Serve replicas register adapters at start only)."""
    if args.lora_dir is None:
        return None
    if on_ray(args):
        raise CliError("--lora-dir: adapters cannot be registered at run time on Ray Serve "
                       "replicas (each has an engine of its own); give them with "
                       "--lora-modules NAME=PATH")
    real = os.path.realpath(args.lora_dir)
    if not os.path.isdir(real):
        raise CliError(f"--lora-dir {args.lora_dir!r}: not an existing folder")
    return real


def priority(text: str) -> int:
    """A scheduling priority (``SamplingParams.priority``'s range)."""
    from diffrt.engine.sampling import MAX_PRIORITY, MIN_PRIORITY

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise argparse.ArgumentTypeError(f"must be {MIN_PRIORITY}..{MAX_PRIORITY}, got {value}")
    return value


def build_serve_settings(args: argparse.Namespace) -> Any:
    """The ServeSettings of the command line."""
    from diffrt.serve import ServeSettings

    return ServeSettings(
        model_name=args.served_model_name, api_key=args.api_key or None,
        max_pending=args.max_pending, shutdown_timeout_s=args.shutdown_timeout,
        max_body_bytes=args.max_body_bytes, max_edit_body_bytes=args.max_edit_body_bytes,
        max_edit_bytes_in_flight=args.max_edit_bytes_in_flight,
        url_ttl_s=args.url_ttl,
        allowed_hosts=allowed_hosts(args), public_url=public_url(args),
        body_timeout_s=args.body_timeout, max_request_line_bytes=args.max_request_line_bytes,
        lora_dir=lora_dir(args), client_priority_floor=args.client_priority_floor)


def http_limits(args: argparse.Namespace) -> Any:
    from diffrt.serve.server import HttpLimits

    return HttpLimits(max_header_bytes=args.max_header_bytes,
                      header_timeout_s=args.header_timeout,
                      keep_alive_timeout_s=args.keep_alive_timeout,
                      limit_concurrency=args.limit_concurrency)


def run(args: argparse.Namespace) -> int:
    from diffrt.cli import listen

    # the flags first, then the address (bound now: a bad or busy one is one
    # line before anything loads), then the model
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
        print(f"diffrt serve: {config.model} ready at http://{args.host}:{port} "
              f"({config.mode.value} mode)", flush=True)

    def on_failed(reason: str) -> None:
        failure.append(reason)
        print(f"diffrt serve: error: the engine could not start: {reason}", file=sys.stderr,
              flush=True)
        assert server is not None
        server.should_exit = True

    app = build_app(config, serve_settings, on_ready=on_ready, on_failed=on_failed)
    server = DrainingServer(uvicorn_config(app, limits, host=args.host, port=args.port),
                            app.state.client, args.shutdown_timeout)
    print(f"diffrt serve: loading {config.model}; http://{args.host}:{args.port}/ready "
          "turns 200 when it is warm", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    return EXIT_FAILURE if failure else 0
