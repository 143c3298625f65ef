"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal the server makes is an ``ApiError``; the handlers installed by
``install_error_handlers`` turn it and FastAPI's validation errors into that
shape, and the request middleware answers anything unexpected the same way,
so a client never sees another body.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from diffrt.serve.protocol import EDIT_ONLY_FIELDS

logger = logging.getLogger(__name__)

#: status -> OpenAI's error type for it
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ApiError(Exception):
    """A response the server gives instead of an image."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _validation_error(exc: RequestValidationError) -> ApiError:
    """The first problem pydantic found, naming the field as OpenAI's ``param``."""
    errors = exc.errors()
    if not errors:
        return ApiError(400, "invalid request body")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if param is None and kind == "missing":  # no body at all
        return ApiError(400, "a JSON object body is required", code="invalid_value")
    if kind == "extra_forbidden" and param in EDIT_ONLY_FIELDS:
        message = f"{param}: applies to an input image; send it to POST /v1/images/edits"
    elif kind == "extra_forbidden":
        message = f"unknown field {param!r}"
    elif kind == "missing":
        message = f"{param}: required"
    elif kind in ("json_invalid", "model_attributes_type", "dict_type"):
        message = "the body must be a JSON object"
        param = None
    else:
        message = f"{param}: {first.get('msg', 'invalid')}" if param else first.get("msg", "")
    return ApiError(400, message, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        return error_response(ApiError(exc.status_code, message,
                                       headers=dict(exc.headers or {})))
