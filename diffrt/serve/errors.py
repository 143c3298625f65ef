"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal the server makes is an ``ApiError``; the handlers installed by
``install_error_handlers`` turn it and FastAPI's validation errors into that
shape, and the request middleware answers anything unexpected the same way,
so a client never sees another body.

What a client sent is quoted back cut short (``echoed``, ``field_name``: a
900 KB ``model`` is not answered with 900 KB), and no message or ``param``
passes ``MAX_MESSAGE_CHARS`` / ``MAX_PARAM_CHARS`` whatever it quotes.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from diffrt.runtime.types import cut, short_repr
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


#: the longest error message and ``param`` answered (a bound whatever they quote)
MAX_MESSAGE_CHARS = 2000
MAX_PARAM_CHARS = 100


def echoed(value: object) -> str:
    """A client's value as an error message quotes it: its repr, cut short."""
    return short_repr(value)


def field_name(name: str) -> str:
    """A field name the client chose (a key, a part's name), cut short: for
    a message's ``name: ...`` and for ``param``."""
    return cut(name, MAX_PARAM_CHARS)


class ApiError(Exception):
    """A response the server gives instead of an image."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        message = cut(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = None if param is None else field_name(param)
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


class BodyRefused(StarletteHTTPException):
    """An ``ApiError`` raised while FastAPI parses a body (``json_body.py``):
    FastAPI passes an HTTPException on as it is, where any other exception
    would become its own "There was an error parsing the body"."""

    def __init__(self, error: ApiError):
        super().__init__(error.status, error.message, headers=error.headers)
        self.error = error


def error_body(status: int, message: str, *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


#: a JSON value's kind in a client's words
_JSON_KINDS = {list: "an array", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null", dict: "an object"}


def _json_kind(value: object) -> str:
    return _JSON_KINDS.get(type(value), type(value).__name__)


def _validation_error(exc: RequestValidationError, path: str = "") -> ApiError:
    """The first problem pydantic found, naming the field as OpenAI's ``param``
    (a key the client chose is cut short, as every quoted value is). An
    edit's field sent to the generation route (``path``) is pointed at the
    edits route; to any other route it is an unknown field."""
    errors = exc.errors()
    if not errors:
        return ApiError(400, "invalid request body")
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":  # FastAPI's loc holds the offset, not a field
        where = first.get("ctx", {}).get("error", "")
        return ApiError(400, "the body must be a JSON object (it is not valid JSON"
                             f"{': ' + where if where else ''})", code="invalid_value")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = field_name(".".join(loc)) if loc else None
    if param is None and kind == "missing":  # no body at all
        return ApiError(400, "a JSON object body is required", code="invalid_value")
    if kind == "extra_forbidden" and param in EDIT_ONLY_FIELDS \
            and path.endswith("/v1/images/generations"):
        message = f"{param}: applies to an input image; send it to POST /v1/images/edits"
    elif kind == "extra_forbidden":
        message = f"unknown field {echoed('.'.join(loc))}"
    elif kind == "missing":
        message = f"{param}: required"
    elif kind in ("model_attributes_type", "dict_type", "model_type"):
        got = _json_kind(first.get("input"))
        message = (f"{param}: must be a JSON object, got {got}" if param
                   else f"the body must be a JSON object, got {got}")
    else:
        message = f"{param}: {first.get('msg', 'invalid')}" if param else first.get("msg", "")
    return ApiError(400, message, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc, request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, BodyRefused):
            return error_response(exc.error)
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        return error_response(ApiError(exc.status_code, message,
                                       headers=dict(exc.headers or {})))
