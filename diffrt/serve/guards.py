"""The checks a request passes before its body is read: its ``Host``, its
API key, and the bound its body is read within.

Both run in the request middleware ahead of the body (FastAPI reads a body
before it resolves a route's dependencies), so a client without the key, or
a web page reaching a loopback server through DNS rebinding, is answered
from the headers alone and holds no body in memory.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
from collections.abc import Sequence

from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import Message, Receive, Scope, Send

from diffrt.serve.errors import ApiError
from diffrt.serve.settings import ServeSettings

#: the one route under /v1 that needs no key: its random id is the credential
_OPEN_V1 = re.compile(r"/v1/images/[^/]+/content")
#: the route whose body carries images (``max_edit_body_bytes``)
EDITS_PATH = "/v1/images/edits"
VIDEOS_PATH = "/v1/videos"
#: the routes whose body may carry a safetensors file (``max_upload_body_bytes``)
WEIGHTS_PATH = "/v1/weights"
LORAS_PATH = "/v1/loras"

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")


def default_allowed_hosts(host: str) -> tuple[str, ...] | None:
    """The ``Host`` names a server bound to ``host`` answers by default: the
    bound address, plus ``localhost`` and the loopback addresses when it is
    a loopback address; any host (None) when it binds every address."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:  # a name: only that name (and loopback's own names)
        return (host, *LOOPBACK_NAMES) if host == "localhost" else (host,)
    if address.is_unspecified:  # 0.0.0.0 / ::: names unknown here
        return None
    if address.is_loopback:
        return tuple(dict.fromkeys((_host_form(address), *LOOPBACK_NAMES)))
    return (_host_form(address),)


def _host_form(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    """The address as a ``Host`` header spells it (IPv6 in brackets)."""
    return f"[{address}]" if address.version == 6 else str(address)


class HostGuard:
    """Starlette's ``TrustedHostMiddleware`` as a check: ``check(scope)``
    raises ApiError(400) for a host it would refuse (its plain-text answer
    is replaced by OpenAI's error shape; no ``www.`` redirect, which would be
    built from the client's Host)."""

    def __init__(self, allowed_hosts: Sequence[str] | None):
        self.allowed = None if allowed_hosts is None else tuple(allowed_hosts)
        self._middleware = TrustedHostMiddleware(_passed, allowed_hosts=allowed_hosts,
                                                 www_redirect=False)

    async def check(self, scope: dict) -> None:
        if self.allowed is None:
            return
        probe = {**scope, "diffrt.host_ok": False}
        await self._middleware(probe, _no_receive, _drop)
        if not probe["diffrt.host_ok"]:
            raise ApiError(400, "this server does not answer for that Host header "
                                "(see diffrt serve --allowed-hosts)", code="invalid_host")


async def _passed(scope: Scope, receive: Receive, send: Send) -> None:
    scope["diffrt.host_ok"] = True


async def _no_receive() -> Message:  # the check never reads a body
    return {"type": "http.disconnect"}


async def _drop(message: Message) -> None:  # the middleware's own refusal: replaced
    return None


def route_path(scope: dict) -> str:
    """The path inside this app (a mount's prefix removed)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


#: routes outside /v1 that change the engine (``rollout_routes.py``): keyed too
KEYED_ROUTES = frozenset({"/sleep", "/wake_up"})


def key_required(scope: dict) -> bool:
    """``/v1/*`` needs the key, except an image's content URL; so do
    ``/sleep`` and ``/wake_up``."""
    path = route_path(scope)
    return path in KEYED_ROUTES or (path.startswith("/v1/") and _OPEN_V1.fullmatch(path) is None)


def check_api_key(scope: dict, keys: tuple[str, ...]) -> str | None:
    """``Authorization: Bearer <key>`` against each of ``keys``, compared as
    UTF-8 bytes (what curl and browsers send for a non-ASCII key), each in
    constant time; the key that matched (None: no key needed here)."""
    if not keys or not key_required(scope):
        return None
    value = b""
    for name, header in scope.get("headers", []):
        if name == b"authorization":
            value = header
            break
    scheme, _, token = value.partition(b" ")
    token = token.strip()
    matched = None
    for key in keys:  # every key compared: the time does not tell which one matched
        if hmac.compare_digest(token, key.encode("utf-8")):
            matched = key
    if scheme.lower() != b"bearer" or matched is None:
        raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")
    return matched


def is_upload(scope: dict) -> bool:
    """A route whose body may carry a safetensors file (``weight_routes.py``):
    ``POST /v1/weights``, ``PUT /v1/loras/{name}``."""
    path = route_path(scope)
    method = scope.get("method", "")
    return ((method == "POST" and path == WEIGHTS_PATH)
            or (method == "PUT" and path.startswith(LORAS_PATH + "/")))


def body_limit(scope: dict, settings: ServeSettings) -> int:
    """The most bytes a request's body may have: an edit's (images), a weight
    upload's, or any other's."""
    path = route_path(scope)
    if path == EDITS_PATH:
        return settings.max_edit_body_bytes
    if path == VIDEOS_PATH:  # its first frame
        return settings.max_video_body_bytes
    if is_upload(scope):
        return settings.max_upload_body_bytes
    return settings.max_body_bytes
