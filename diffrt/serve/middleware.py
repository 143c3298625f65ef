"""One ASGI middleware around every request: its id, the body-size limit,
the access log line and the count of answers by status.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which buffers streamed
responses and hides client disconnects from the handlers.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from diffrt.serve.errors import ApiError, error_body

access_log = logging.getLogger("diffrt.serve.access")

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
            declared = _content_length(scope)
            if declared is not None and declared > self.max_body_bytes:
                await self._too_large(send_with_id)
                return
            await self.app(scope, self._limited(receive), send_with_id)
        finally:
            if self.on_response is not None and status[0]:
                self.on_response(status[0])
            access_log.info("%s %s %s %d %.3fs", request_id, scope.get("method"),
                            scope.get("path"), status[0], time.monotonic() - start)

    def _limited(self, receive: Any) -> Any:
        """``receive`` that refuses a body growing past the limit (chunked
        uploads declare no length)."""
        seen = [0]

        async def receive_limited() -> dict:
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.max_body_bytes:
                    raise ApiError(413, f"request body larger than {self.max_body_bytes} bytes",
                                   code="request_too_large")
            return message

        return receive_limited

    async def _too_large(self, send: Any) -> None:
        import json

        body = json.dumps(error_body(413, f"request body larger than {self.max_body_bytes} "
                                          "bytes", code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
