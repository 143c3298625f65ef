"""What a server needs besides the engine's own configuration."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeSettings:
    """Server options (``diffrt serve`` flags); the engine's are an EngineConfig.

    Attributes:
        model_name: the id clients send as ``model`` and ``/v1/models`` lists
            (default: the engine's model).
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <key>``;
            ``/health``, ``/ready`` and ``/metrics`` stay open.
        max_pending: more requests than this waiting (accepted, not yet
            running) and new ones get 429 with Retry-After.
        retry_after_s: the Retry-After a 429 suggests.
        shutdown_timeout_s: on SIGTERM/SIGINT, how long requests in flight may
            take to finish before they are aborted.
        max_body_bytes: larger request bodies get 413.
        max_edit_body_bytes: the same bound for ``POST /v1/images/edits``,
            whose body carries images (every image and the mask together).
        max_edit_bytes_in_flight: the bytes of edit bodies held at once
            (being received, or read into the engine's arrays); an edit
            whose body finds no room gets 429 with Retry-After.
        url_ttl_s / url_max_images / url_max_bytes: ``response_format="url"``
            images are kept this long, at most this many and this many bytes;
            an unexpired image is never evicted: a url request that does not
            fit is refused (429).
        allowed_hosts: the ``Host`` names (``*.example.com`` patterns allowed)
            the server answers; others get 400. None: any host (the app alone;
            ``diffrt serve`` derives a default from the address it binds).
        public_url: the base of the URLs of ``response_format="url"`` images
            (e.g. ``https://images.example.com``); None: relative URLs. Never
            built from the request's ``Host``.
        body_timeout_s: a request body not read whole within this is 408.
        max_request_line_bytes: a longer request target (path and query) is 414.
        lora_dir: the folder ``POST /v1/loras`` may register adapters from
            (a path is accepted when its real path, symlinks resolved, lies
            inside this folder's); None: run-time registration is refused
            (403), so no client can make the server read a file of its
            choosing. Adapters given at start (``lora_modules``) need none.
        client_priority_floor: an HTTP request whose ``priority`` is below
            this is refused (400), so clients cannot claim the classes the
            operator keeps for others; None: any priority the engine takes.

    The bounds of the connection itself (header size and time, idle time, the
    count of connections) are uvicorn's: ``diffrt.serve.server.HttpLimits``.
    """

    model_name: str | None = None
    api_key: str | None = None
    max_pending: int = 64
    retry_after_s: int = 1
    shutdown_timeout_s: float = 30.0
    max_body_bytes: int = 1 << 20
    max_edit_body_bytes: int = 32 << 20
    max_edit_bytes_in_flight: int = 256 << 20
    url_ttl_s: float = 600.0
    url_max_images: int = 256
    url_max_bytes: int = 256 << 20
    allowed_hosts: tuple[str, ...] | None = None
    public_url: str | None = None
    body_timeout_s: float = 30.0
    max_request_line_bytes: int = 8 << 10
    lora_dir: str | None = None
    client_priority_floor: int | None = None
