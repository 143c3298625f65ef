"""`diffrt bench --base-url`: the bench's load on a running server, over HTTP.

``HttpTarget`` sends each request as the OpenAI images API body (non-streamed,
``b64_json``) and measures it as a client sees it; the server's own phase
timings come back in the response's ``diffrt`` field. A request that fails,
times out or loses its connection is counted as a failure with its status
(0: no answer) and never holds the bench up past ``timeout_s``; after
``GONE_AFTER`` unanswered requests in a row the server is taken for gone and
the rest are counted without being sent. An HTTP target's "output" time is
the server's output wait plus its post-processing.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from diffrt.cli.bench_stats import Sample
from diffrt.cli.errors import CliError


def request_body(request: Any) -> dict[str, Any]:
    """A DiffusionRequest as the body of POST /v1/images/generations (its
    sampling fields by their declared HTTP names, ``protocol.SAMPLING_FIELDS``)."""
    from diffrt.engine.sampling import SamplingParams
    from diffrt.serve.protocol import SAMPLING_FIELDS

    params, defaults = request.sampling_params, SamplingParams()
    body: dict[str, Any] = {"prompt": request.prompt, "response_format": "b64_json"}
    if params.height is not None and params.width is not None:
        body["size"] = f"{params.width}x{params.height}"
    if request.negative_prompt is not None:
        body["negative_prompt"] = request.negative_prompt
    for f in SAMPLING_FIELDS:
        value = getattr(params, f.field)
        if value is not None and value != getattr(defaults, f.field):  # the server's default
            body[f.http] = value * f.scale if f.scale != 1.0 else value
    return body


class HttpTarget:
    """A running ``diffrt serve`` (or any OpenAI images server) as a load target."""

    #: this many requests in a row without an answer: the server is gone, and
    #: the rest are counted as unanswered without being sent
    GONE_AFTER = 3

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float = 300.0,
                 transport: Any = None):
        self.base_url = base_url.rstrip("/")
        self.transport = transport  # an httpx transport (default: the network)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self._client: Any = None
        self._unanswered_in_a_row = 0

    def _session(self) -> Any:
        import httpx

        if self._client is None:  # made inside the running event loop
            # no pool limit: the load's own concurrency is the limit, and a
            # request queued in the pool would count its wait as latency
            self._client = httpx.AsyncClient(
                base_url=self.base_url, headers=self.headers, timeout=self.timeout_s,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                transport=self.transport)
        return self._client

    async def run_request(self, request: Any) -> Sample:
        import httpx

        start = time.perf_counter()
        if self._unanswered_in_a_row >= self.GONE_AFTER:
            return Sample(latency=0.0, ok=False, status=0,
                          error="not sent: the server stopped answering")
        try:
            # the whole request is bounded (httpx's timeout is per phase: a
            # server trickling bytes would never trip it)
            response = await asyncio.wait_for(
                self._session().post("/v1/images/generations", json=request_body(request)),
                self.timeout_s)
        except (httpx.HTTPError, asyncio.TimeoutError) as exc:
            self._unanswered_in_a_row += 1
            return Sample(latency=time.perf_counter() - start, ok=False, status=0,
                          error=f"no answer: {type(exc).__name__}: {exc}")
        self._unanswered_in_a_row = 0
        latency = time.perf_counter() - start
        try:
            doc = response.json()
        except ValueError:
            doc = None
        if response.status_code != 200:
            error = doc.get("error") if isinstance(doc, dict) else None
            message = error.get("message") if isinstance(error, dict) else None
            return Sample(latency=latency, ok=False, status=response.status_code,
                          error=f"HTTP {response.status_code}: {message or response.text[:200]}")
        data = doc.get("data") if isinstance(doc, dict) else None
        wanted = request.sampling_params.num_outputs_per_prompt
        if not isinstance(data, list) or len(data) != wanted:
            return Sample(latency=latency, ok=False, status=200,
                          error=f"malformed answer: expected {wanted} image(s) in 'data'")
        info = doc.get("diffrt")
        timings = (info.get("timings") if isinstance(info, dict) else None) or {}
        return Sample(latency=latency, ok=True, images=len(data),
                      queue_wait=timings.get("queue"), forward_time=timings.get("inference"),
                      output_wait=timings.get("output"), status=200)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def served_model(base_url: str, api_key: str | None, timeout_s: float = 30.0) -> str:
    """The model the server's images come from (the first of GET /v1/models);
    a clear error when there is no server there."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url.rstrip('/')}/v1/models", headers=headers,
                             timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise CliError(f"--base-url {base_url}: no server answers ({exc})") from None
    if response.status_code == 401:
        raise CliError(f"--base-url {base_url}: the server wants an API key (--api-key)")
    try:
        # the images' model first (the default model's server lists its video model after it)
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, TypeError, IndexError):
        raise CliError(f"--base-url {base_url}: /v1/models answered {response.status_code}, "
                       "not an OpenAI model list") from None
