"""One ASGI middleware around every request: its id, the checks made before
its body is read, the body itself (bounded in size and time), the access log
line and the count of answers by status.

In order: a request target longer than ``max_request_line_bytes`` is 414,
a ``Host`` the server does not answer is 400, a missing or wrong API key is
401 (``guards.py``: all from the headers, nothing of the body read yet); then
the body is read within ``max_body_bytes`` (413; an edit's, which carries
images, within ``max_edit_body_bytes``: ``guards.body_limit``) and
``body_timeout_s`` (408), and handed to the app whole (a prompt and a few
fields, or an edit's images: parsed from memory, ``edit_body.py``). The
edit bodies held at once share ``max_edit_bytes_in_flight``
(``body_budget.py``: 429 past it), and a body is referenced only until the
app has read it, not while its request waits for the engine. A client that leaves before its body is complete is not served:
nothing of a cut-short body reaches the engine.

Every refusal is an ``ApiError`` answered in OpenAI's shape, as the app's
own handlers answer theirs. Plain ASGI rather than Starlette's
BaseHTTPMiddleware, which buffers streamed responses and hides client
disconnects from the handlers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from diffrt.serve.body_budget import BodyBudget, BodyHold
from diffrt.serve.errors import ApiError, error_body
from diffrt.serve.guards import EDITS_PATH, HostGuard, body_limit, check_api_key, route_path
from diffrt.serve.logsafe import escape
from diffrt.serve.settings import ServeSettings
from diffrt.serve.video_jobs import owner_of

access_log = logging.getLogger(__name__)

REQUEST_ID_HEADER = b"x-request-id"


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


class RequestContext:
    def __init__(self, app: Any, *, settings: ServeSettings, on_response: Any = None):
        self.app = app
        self.settings = settings
        self.hosts = HostGuard(settings.allowed_hosts)
        self.on_response = on_response
        self.edit_bodies = BodyBudget(settings.max_edit_bytes_in_flight,
                                      settings.retry_after_s)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # uuid4: time-based ids collide under concurrency (vllm-omni #1080)
        request_id = uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        hold = self.edit_bodies.hold() if route_path(scope) == EDITS_PATH else None
        if hold is not None:  # the edit route gives the room back once it has read the body
            state["release_body"] = hold.release
        start = time.monotonic()
        state["arrived_at"] = start  # a deadline counts from here (routes.counted_from_arrival)
        status = [0]

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REQUEST_ID_HEADER, request_id.encode())]}
            await send(message)

        try:
            self._check_request_line(scope)
            await self.hosts.check(scope)
            # the key's owner digest, when several keys split the video jobs
            state["owner"] = self._owner(check_api_key(scope, self.settings.api_keys))
            # no reference to the body here: it goes once the app has read it
            await self.app(scope, _replay(await self._read_body(scope, receive, hold), receive),
                           send_with_id)
        except ClientGone:
            access_log.info("%s: the client left before its body was complete", request_id)
        except ApiError as exc:
            if not status[0]:  # refused before the app: the body may still be coming,
                # so the connection is closed rather than left to receive it
                await _send_json(send_with_id, exc.status, exc.body(),
                                 {**exc.headers, "Connection": "close"})
        except Exception as exc:
            # what the app's handlers did not turn into a response: still
            # OpenAI's shape, with the request id
            access_log.exception("%s: unhandled error", request_id)
            if not status[0]:
                await _send_json(send_with_id, 500, error_body(
                    500, f"internal error: {type(exc).__name__}"))
        finally:
            if hold is not None:
                hold.release()
            if self.on_response is not None and status[0]:
                self.on_response(status[0])
            access_log.info("%s %s %s %d %.3fs", request_id, escape(scope.get("method", "")),
                            escape(scope.get("path", "")), status[0], time.monotonic() - start)

    def _owner(self, key: str | None) -> str | None:
        """Whose video jobs a request sees: one owner per key when several keys
        are configured (``video_jobs.owner_of``); everyone's (None) otherwise."""
        return owner_of(key) if key is not None and len(self.settings.api_keys) > 1 else None

    def _check_request_line(self, scope: dict) -> None:
        target = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        if target > self.settings.max_request_line_bytes:
            raise ApiError(414, f"request target longer than "
                                f"{self.settings.max_request_line_bytes} bytes",
                           code="uri_too_long")

    async def _read_body(self, scope: dict, receive: Any, hold: BodyHold | None) -> bytes:
        """The whole request body, within its bound (``guards.body_limit``: a
        declared length is refused before reading, a chunked upload as it
        grows), ``body_timeout_s`` and, for an edit, room in the budget of
        edit bodies (``hold``). Raises ApiError (413, 408, 429) or ClientGone."""
        limit = body_limit(scope, self.settings)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            raise _too_large(limit)
        if hold is not None and declared is not None:
            hold.grow(declared)
        timeout = self.settings.body_timeout_s
        try:
            return await asyncio.wait_for(self._chunks(receive, limit, hold), timeout)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {timeout:g} s",
                           code="request_timeout") from None

    async def _chunks(self, receive: Any, limit: int, hold: BodyHold | None) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left mid-body
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            if hold is not None:
                hold.grow(size)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body larger than {limit} bytes", code="request_too_large")


async def _send_json(send: Any, status: int, doc: dict,
                     headers: dict[str, str] | None = None) -> None:
    body = json.dumps(doc).encode()
    extra = [(k.lower().encode("latin-1"), v.encode("latin-1"))
             for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body})


def _replay(body: bytes, receive: Any) -> Any:
    """``receive`` for the app: the body read already (then dropped: the app
    holds it as long as it needs it), then the client's own messages (so a
    disconnect still reaches the handler)."""
    held: list[bytes] = [body]

    async def replay() -> dict:
        if held:
            return {"type": "http.request", "body": held.pop(), "more_body": False}
        return await receive()

    return replay


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
