"""One ASGI middleware around every request: its id, the body-size limit,
the access log line and the count of answers by status.

The body is read here, within the limit, and handed to the app whole (bodies
are small: a prompt and a few fields); a larger one is answered 413 at once.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which buffers streamed
responses and hides client disconnects from the handlers.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from diffrt.serve.errors import error_body

access_log = logging.getLogger(__name__)

REQUEST_ID_HEADER = b"x-request-id"


class RequestContext:
    def __init__(self, app: Any, *, max_body_bytes: int, on_response: Any = None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.on_response = on_response

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # uuid4: time-based ids collide under concurrency (vllm-omni #1080)
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        start = time.monotonic()
        status = [0]

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REQUEST_ID_HEADER, request_id.encode())]}
            await send(message)

        try:
            body = await self._read_body(scope, receive)
            if body is None:
                await self._too_large(send_with_id)
                return
            await self.app(scope, _replay(body, receive), send_with_id)
        except Exception as exc:
            # what the app's handlers did not turn into a response: still
            # OpenAI's shape, with the request id
            access_log.exception("%s: unhandled error", request_id)
            if not status[0]:
                await _send_json(send_with_id, 500, error_body(
                    500, f"internal error: {type(exc).__name__}"))
        finally:
            if self.on_response is not None and status[0]:
                self.on_response(status[0])
            access_log.info("%s %s %s %d %.3fs", request_id, scope.get("method"),
                            scope.get("path"), status[0], time.monotonic() - start)

    async def _read_body(self, scope: dict, receive: Any) -> bytes | None:
        """The whole request body, or None past the limit (a declared length is
        refused before reading; a chunked upload as it grows)."""
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, send: Any) -> None:
        await _send_json(send, 413, error_body(
            413, f"request body larger than {self.max_body_bytes} bytes",
            code="request_too_large"))


async def _send_json(send: Any, status: int, doc: dict) -> None:
    body = json.dumps(doc).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _replay(body: bytes, receive: Any) -> Any:
    """``receive`` for the app: the body read already, then the client's own
    messages (so a disconnect still reaches the handler)."""
    sent = [False]

    async def replay() -> dict:
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
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
