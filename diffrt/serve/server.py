"""uvicorn's server with a drain before it stops.

The first SIGTERM or SIGINT does not stop the server at once: the
EngineClient drains (``/ready`` and new requests 503, requests in flight get
``shutdown_timeout_s`` to finish, the rest are aborted with an error), and only
then does uvicorn stop; the app's lifespan closes the engine (workers exit,
the shared-memory arena is freed). A second signal stops at once.

uvicorn re-raises the signals it caught once it has stopped, which would end
the process by the signal; the drain records none, so the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import uvicorn

from diffrt.serve.engine_client import EngineClient

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, client: EngineClient, shutdown_timeout_s: float):
        super().__init__(config)
        self.client = client
        self.shutdown_timeout_s = shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_task: asyncio.Future | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            await super().serve(sockets)
        finally:  # a forced exit skips the app's lifespan shutdown: close here too
            await self.client.close()

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._draining or self._loop is None:  # a second signal: stop now
            self.should_exit = True
            self.force_exit = self._draining
            return
        self._draining = True
        logger.info("signal %d: draining", sig)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())  # kept: not collected midway

    async def _drain(self) -> None:
        try:
            await self.client.drain(self.shutdown_timeout_s)
        finally:
            self.should_exit = True

    def bound_port(self) -> int | None:
        """The port the server listens on (``port=0`` picks a free one)."""
        try:
            return self.servers[0].sockets[0].getsockname()[1]
        except (AttributeError, IndexError, TypeError):
            return None
