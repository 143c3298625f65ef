"""The HTTP edge in-process (ASGI, the toy engine): what is checked before a
body is read (key, Host, request line), the body's bounds in size and time, a
cut-short body, the url store's bounds, URLs never built from the Host, and
log lines a client cannot forge (issue 27, items 6, 8, 9, 10, 12)."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from serve_helpers import API_KEY, AUTH, call

from diffrt.serve import ServeSettings
from diffrt.serve.guards import default_allowed_hosts
from diffrt.serve.images import ImageStore, StoreFull
from diffrt.serve.logsafe import escape

GEN = "/v1/images/generations"
SMALL = {"size": "16x16", "num_inference_steps": 2}


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def asgi(app, path: str, messages: list[dict] | None, *, method: str = "POST",
         headers: list[tuple[bytes, bytes]] = (), timeout: float = 5.0,
         raw_path: bytes | None = None) -> tuple[int, dict, list[dict]]:
    """One request straight through ASGI, its body as ``messages`` (None: a
    client that never sends one). Returns (status, headers, what was sent);
    status 0 when nothing was answered."""
    sent: list[dict] = []

    async def main() -> None:
        queue = list(messages or [])

        async def receive() -> dict:
            if queue:
                return queue.pop(0)
            await asyncio.sleep(3600)  # the client sends nothing more
            raise AssertionError("unreachable")

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": method, "scheme": "http", "path": path,
                 "raw_path": raw_path if raw_path is not None else path.encode(),
                 "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8000),
                 "client": ("127.0.0.1", 5000),
                 "headers": [(b"host", b"127.0.0.1:8000"), *headers]}
        await asyncio.wait_for(app(scope, receive, send), timeout)

    asyncio.run(main())
    start = next((m for m in sent if m["type"] == "http.response.start"), None)
    if start is None:  # nothing answered
        return 0, {}, sent
    return start["status"], dict(start["headers"]), sent


# -- item 6 / 12: the key before the body --------------------------------------------------
def test_the_key_is_checked_before_any_body_is_read(toy_app):
    """A client that declares a 1 MB body and sends none of it is answered 401
    at once (before: the server waited for the body, holding the connection)."""
    app = toy_app()
    status, _, _ = asgi(app, GEN, None, headers=[(b"content-length", b"1000000"),
                                                 (b"content-type", b"application/json")])
    assert status == 401


def test_malformed_json_without_the_key_is_401_not_400(toy_app):
    app = toy_app()
    r = call(app, "POST", GEN, content=b"{not json", headers={"content-type": "application/json"})
    assert _error(r, 401)["code"] == "invalid_api_key"


def test_a_non_ascii_key_is_compared_as_utf8_bytes(toy_app):
    key = "clé-ключ"
    app = toy_app(ServeSettings(api_key=key))
    ok = call(app, "GET", "/v1/models",
              headers={"Authorization": f"Bearer {key}".encode()})
    assert ok.status_code == 200, ok.text
    latin1 = call(app, "GET", "/v1/models",
                  headers={"Authorization": f"Bearer {key[:3]}".encode("latin-1")})
    assert latin1.status_code == 401


def test_several_keys_each_serve_the_images_api(toy_app):
    """``api_key`` as several keys: each one is accepted on every route (an
    image belongs to no key: only video jobs are split by key), others 401."""
    app = toy_app(ServeSettings(api_key=("first-key", "second-key")))
    for key in ("first-key", "second-key"):
        r = call(app, "POST", GEN, json={"prompt": "x", **SMALL},
                 headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and r.json()["data"][0]["b64_json"], r.text
    for wrong in ("first-key,second-key", "second", ""):
        r = call(app, "GET", "/v1/models", headers={"Authorization": f"Bearer {wrong}"})
        assert r.status_code == 401, wrong


# -- item 6: the body's bounds; item 12: a body cut short ---------------------------------
def test_a_body_that_does_not_arrive_in_time_is_408(toy_app):
    app = toy_app(ServeSettings(api_key=API_KEY, body_timeout_s=0.3))
    first = {"type": "http.request", "body": b'{"prompt": ', "more_body": True}
    status, _, sent = asgi(app, GEN, [first], headers=[
        (b"authorization", f"Bearer {API_KEY}".encode()), (b"content-type", b"application/json")])
    assert status == 408
    assert json.loads(sent[-1]["body"])["error"]["code"] == "request_timeout"


def test_a_body_cut_short_by_a_leaving_client_is_never_submitted(toy_app):
    app = toy_app()
    engine = app.state.client.engine
    body = json.dumps({"prompt": "complete-looking", **SMALL}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": True},
                {"type": "http.disconnect"}]
    status, _, sent = asgi(app, GEN, messages, headers=[
        (b"authorization", f"Bearer {API_KEY}".encode()), (b"content-type", b"application/json")])
    assert status == 0
    assert sent == []  # nobody to answer
    assert sum(engine.stats().requests_total.values()) == 0
    assert engine.stats().requests_running == engine.stats().requests_waiting == 0


def test_a_long_request_line_is_414(toy_app):
    app = toy_app(ServeSettings(api_key=API_KEY, max_request_line_bytes=100))
    status, _, _ = asgi(app, "/health", None, method="GET", raw_path=b"/health?" + b"x" * 200)
    assert status == 414
    assert call(app, "GET", "/health").status_code == 200


# -- item 12: small edges ----------------------------------------------------------------------
def test_an_empty_body_says_a_json_object_is_required(toy_app):
    app = toy_app()
    error = _error(call(app, "POST", GEN, content=b"",
                        headers={**AUTH, "content-type": "application/json"}), 400)
    assert "None" not in error["message"] and "JSON object" in error["message"]


def test_sizes_take_ascii_digits_only(toy_app):
    app = toy_app()
    error = _error(call(app, "POST", GEN, json={"prompt": "x", "size": "６４x６４"}), 400)
    assert error["param"] == "size"


# -- item 9: Host ------------------------------------------------------------------------------
def test_only_the_allowed_hosts_are_answered(toy_app):
    app = toy_app(ServeSettings(api_key=API_KEY, allowed_hosts=default_allowed_hosts("127.0.0.1")))

    def with_host(host: str) -> httpx.Response:
        return call(app, "GET", "/health", headers={"host": host})

    for host in ("127.0.0.1:8000", "localhost:8000", "localhost", "[::1]:8000"):
        assert with_host(host).status_code == 200, host
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example"):
        assert _error(with_host(host), 400)["code"] == "invalid_host", host


def test_default_allowed_hosts_follow_the_bound_address():
    assert set(default_allowed_hosts("127.0.0.1")) >= {"127.0.0.1", "localhost"}
    assert set(default_allowed_hosts("::1")) >= {"[::1]", "localhost"}
    assert default_allowed_hosts("10.1.2.3") == ("10.1.2.3",)
    assert default_allowed_hosts("0.0.0.0") is None  # every address: --allowed-hosts says


def test_no_redirect_is_built_from_the_host(toy_app):
    app = toy_app()
    r = call(app, "POST", f"{GEN}/", json={"prompt": "x"},
             headers={**AUTH, "host": "evil.example"})
    assert r.status_code == 404 and "location" not in r.headers


def test_url_responses_are_relative_or_under_the_public_url(toy_app):
    body = {"prompt": "x", "response_format": "url", **SMALL}
    app = toy_app()
    url = call(app, "POST", GEN, json=body, headers={**AUTH, "host": "evil.example"}
               ).json()["data"][0]["url"]
    assert url.startswith("/v1/images/") and url.endswith("/content")
    assert call(app, "GET", url).status_code == 200
    public = toy_app(ServeSettings(api_key=API_KEY, public_url="https://img.example.com/"))
    url = call(public, "POST", GEN, json=body, headers={**AUTH, "host": "evil.example"}
               ).json()["data"][0]["url"]
    assert url.startswith("https://img.example.com/v1/images/")


# -- item 10: the url store ----------------------------------------------------------------------
def test_an_unexpired_image_is_never_evicted():
    now = [0.0]
    store = ImageStore(ttl_s=10, max_images=2, max_bytes=100, clock=lambda: now[0])
    a = store.put(b"a", "image/png")
    now[0] = 4
    b = store.put(b"b", "image/png")
    with pytest.raises(StoreFull) as full:
        store.reserve(1, 1)
    assert full.value.retry_after_s == 6  # a expires at 10
    assert store.get(a) and store.get(b)
    by_bytes = ImageStore(ttl_s=10, max_images=9, max_bytes=100)
    by_bytes.put(b"x" * 60, "image/png")
    with pytest.raises(StoreFull):  # bytes too
        by_bytes.reserve(1, 60)
    with pytest.raises(ValueError):  # never fits, however long one waits
        ImageStore(ttl_s=10, max_images=9, max_bytes=100).reserve(2, 60)
    now[0] = 10.5  # a expired: room for one
    room = store.reserve(1, 1)
    assert store.get(a) is None and store.get(b)
    with pytest.raises(StoreFull):
        store.reserve(1, 1)  # the reservation holds its place
    room.release()
    assert store.reserve(1, 1).count == 1


def test_a_url_request_that_does_not_fit_is_429_at_submission(toy_app):
    app = toy_app(ServeSettings(api_key=API_KEY, url_max_images=3, url_ttl_s=60))
    engine = app.state.client.engine
    body = {"prompt": "x", "response_format": "url", **SMALL}
    first = call(app, "POST", GEN, json={**body, "n": 2})
    assert first.status_code == 200, first.text
    before = sum(engine.stats().requests_total.values())
    refused = call(app, "POST", GEN, json={**body, "n": 2})
    assert _error(refused, 429)["code"] == "url_store_full"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert sum(engine.stats().requests_total.values()) == before  # never submitted
    for item in first.json()["data"]:  # the first client's images are still there
        assert call(app, "GET", item["url"]).status_code == 200
    assert call(app, "POST", GEN, json=body).status_code == 200  # one still fits
    never = _error(call(app, "POST", GEN, json={**body, "n": 4}), 400)  # not even if empty
    assert never["param"] == "response_format" and "b64_json" in never["message"]
    text = call(app, "GET", "/metrics").text
    assert "diffrt_url_images 3.0" in text and "diffrt_url_images_max 3.0" in text
    assert "diffrt_url_image_bytes_max" in text and "diffrt_url_images_reserved 0.0" in text


# -- item 8: logs ------------------------------------------------------------------------------
def test_a_client_cannot_forge_or_flood_log_lines(toy_app, caplog):
    app = toy_app()
    caplog.set_level(logging.INFO, logger="diffrt.serve.middleware")
    forged = "/health\nINFO diffrt.serve.middleware: deadbeef POST /v1 200\x00" + "x" * 5000
    status, _, _ = asgi(app, forged, [{"type": "http.request", "body": b""}], method="GET")
    assert status == 404
    [line] = [r.getMessage() for r in caplog.records if r.name == "diffrt.serve.middleware"]
    assert "\n" not in line and "\x00" not in line and "\\n" in line and "\\x00" in line
    assert len(line) < 400


def test_escape():
    assert escape("a\nb\x00\x1b[31m\u2028\\") == "a\\nb\\x00\\x1b[31m\\u2028\\\\"
    assert escape("é ok") == "é ok"
    assert escape("x" * 300, limit=10) == "x" * 10 + "...(+290 chars)"
