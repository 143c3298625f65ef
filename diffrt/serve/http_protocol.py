"""uvicorn's h11 protocol with bounds on the size of a request's head and on
the time to send it.

uvicorn times out an idle keep-alive connection, but not a connection that
opens and sends nothing, nor one that sends its request line and headers a
byte at a time: either holds a connection (and a slot of the concurrency
limit) for as long as the client likes. This protocol gives every request
head ``header_timeout_s`` from the moment the server waits for it (the
connection opened, or the first byte of the next request on a kept-alive
connection) and closes the connection past it.

The head's size: h11 bounds what it buffers of a head still incomplete
(``h11_max_incomplete_event_size``), but a large head that arrives whole
passes; the parsed head (request line and headers) is measured too. A head
over ``max_header_bytes`` either way is answered 400 and the connection closed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE  # as uvicorn's h11_impl does
from uvicorn.protocols.http.h11_impl import H11Protocol

from diffrt.serve.settings import HttpLimits

logger = logging.getLogger(__name__)

#: default seconds a client has to send a request's line and headers (declared there)
DEFAULT_HEADER_TIMEOUT_S = HttpLimits().header_timeout_s


class HeadTimeoutH11Protocol(H11Protocol):
    """H11Protocol that closes a connection whose request head is late."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._max_head = (self.config.h11_max_incomplete_event_size
                          or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE)
        parse = self.conn.next_event

        def next_event() -> Any:
            event = parse()
            if isinstance(event, h11.Request) and _head_size(event) > self._max_head:
                raise h11.RemoteProtocolError(f"request head over {self._max_head} bytes")
            return event

        self.conn.next_event = next_event  # type: ignore[method-assign]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_head_timer()  # a new connection owes a head at once

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _follow_head(self) -> None:
        """A head in progress (bytes buffered, no request yet) is timed; once
        the request is in, or while nothing is sent (uvicorn's keep-alive
        timeout covers an idle connection), it is not."""
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self._arm_head_timer()
        elif self.conn.their_state is not h11.IDLE:
            self._cancel_head_timer()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_late)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            logger.debug("closing a connection whose request head took over %.1f s",
                         self.header_timeout_s)
            self.transport.close()


def _head_size(event: h11.Request) -> int:
    """The bytes of a request line and headers as sent (give or take spacing)."""
    line = len(event.method) + len(event.target) + 11  # spaces, HTTP/1.1, CRLF
    return line + sum(len(name) + len(value) + 4 for name, value in event.headers)


def with_header_timeout(seconds: float) -> type[HeadTimeoutH11Protocol]:
    """The protocol class for one server (uvicorn builds it without options)."""
    return type("HeadTimeoutH11Protocol", (HeadTimeoutH11Protocol,),
                {"header_timeout_s": seconds})
