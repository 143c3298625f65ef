"""Ray Serve's proxy checks, lengthened for the Ray instance diffrt starts.

Serve's controller asks a new HTTP proxy actor whether it is ready within
``RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S`` (5 s in Ray 2.60) and health-checks
it within ``RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S`` (10 s); three misses and
it kills the proxy, and ``serve.start`` fails with ``ActorDiedError``
("killed by ray.kill ... cancelled before it started running"). On a
2-CPU machine that other processes keep busy, a proxy's imports alone took
longer than three of those checks: ``diffrt serve --replicas 2`` could not
start. The constants are read from the environment when the controller's
process imports Ray Serve, and a local instance's processes inherit the
environment of the process that starts it, so setting them before
``ray.init`` is enough there (a cluster started elsewhere keeps its own).
A longer check only delays noticing a proxy that really died.

``serve.start`` itself waits 60 s for the proxies (``HTTP_PROXY_TIMEOUT``, a
constant) and then raises ``TimeoutError`` while the controller goes on
starting them; ``start_serve`` then calls it again, which connects to the
running controller, and the server's readiness waits for the proxy as it
always does (``/ready`` answers through it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any

logger = logging.getLogger(__name__)

#: seconds Serve waits for a proxy's readiness and health answers
PROXY_CHECKS_S = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
                  "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}


def lengthen_proxy_checks(environ: MutableMapping[str, str] = os.environ) -> None:
    """Give a local Ray instance's Serve proxy ``PROXY_CHECKS_S`` (a value the
    user set already is kept); call before ``ray.init`` starts it."""
    for name, seconds in PROXY_CHECKS_S.items():
        environ.setdefault(name, seconds)


def start_serve(serve: Any, http_options: dict[str, Any]) -> None:
    """``serve.start``, waiting out proxies slower than its 60 s (see the module)."""
    try:
        serve.start(http_options=http_options)
    except TimeoutError as exc:
        logger.warning("Ray Serve: %s; the controller keeps starting them, waiting on", exc)
        serve.start(http_options=http_options)


__all__ = ["PROXY_CHECKS_S", "lengthen_proxy_checks", "start_serve"]
