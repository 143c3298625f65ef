"""uvicorn's server with a drain before it stops, and the bounds of its
connections (``HttpLimits``, declared in ``settings.py``).

The first SIGTERM or SIGINT does not stop the server at once: the
EngineClient drains (``/ready`` and new requests 503, requests in flight get
``shutdown_timeout_s`` to finish, the rest are aborted with an error), and only
then does uvicorn stop; the app's lifespan closes the engine (workers exit,
the shared-memory arena is freed). A second signal ends the drain at once:
the requests in flight are aborted and answered 503, then the server stops as
after a drain (no traceback, exit 0). A third stops uvicorn without waiting.

uvicorn re-raises the signals it caught once it has stopped, which would end
the process by the signal; the drain records none, so the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import uvicorn

from diffrt.serve.engine_client import EngineClient, close_all
from diffrt.serve.http_protocol import with_header_timeout
from diffrt.serve.settings import HttpLimits

logger = logging.getLogger(__name__)


def uvicorn_config(app: Any, limits: HttpLimits, *, host: str, port: int) -> uvicorn.Config:
    """The uvicorn configuration of ``diffrt serve``: h11 (whose head-size bound
    httptools lacks) with the head timeout, the keep-alive and concurrency
    bounds, diffrt's own access log (uvicorn's off) and the app's lifespan."""
    return uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False,
                          timeout_graceful_shutdown=5, lifespan="on",
                          http=with_header_timeout(limits.header_timeout_s),
                          h11_max_incomplete_event_size=limits.max_header_bytes,
                          # uvicorn annotates int; it hands the value to loop.call_later
                          timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]
                          limit_concurrency=limits.limit_concurrency)


class DrainingServer(uvicorn.Server):
    """uvicorn's server that drains ``clients`` (the app's ``state.clients``:
    every engine it serves) before it stops."""

    def __init__(self, config: uvicorn.Config, clients: tuple[EngineClient, ...],
                 shutdown_timeout_s: float):
        super().__init__(config)
        self.clients = clients
        self.shutdown_timeout_s = shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        self._drain_task: asyncio.Future | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            await super().serve(sockets)
        finally:  # a forced exit skips the app's lifespan shutdown: close here too
            await close_all(self.clients)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._loop is None:  # before serving: stop
            self.should_exit = True
            return
        self._signals += 1
        if self._signals == 1:
            logger.info("signal %d: draining", sig)
            self._loop.call_soon_threadsafe(self._start_drain)
        elif self._signals == 2:
            logger.info("signal %d again: ending the drain now", sig)
            for client in self.clients:
                self._loop.call_soon_threadsafe(client.end_drain)
        else:  # the drain itself is stuck: stop without waiting
            self.should_exit = self.force_exit = True

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())  # kept: not collected midway

    async def _drain(self) -> None:
        try:
            await asyncio.gather(*(c.drain(self.shutdown_timeout_s) for c in self.clients))
        finally:
            self.should_exit = True

    def bound_port(self) -> int | None:
        """The port the server listens on (``port=0`` picks a free one)."""
        try:
            return self.servers[0].sockets[0].getsockname()[1]
        except (AttributeError, IndexError, TypeError):
            return None


__all__ = ["DrainingServer", "HttpLimits", "uvicorn_config"]
