"""The app in-process (httpx ASGI transport, engines on the in-process
executor): the API's shapes, refusals, streams, limits and states."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import time

import engine_toy
import httpx
import pytest
from faults import hold_restarts, kill_executor
from PIL import Image
from serve_helpers import API_KEY, AUTH, call
from serve_helpers import events as _events
from waiting import wait_for, wait_until

from diffrt.serve import ServeSettings
from diffrt.serve.images import ImageStore, StoreFull

GEN = "/v1/images/generations"


def _png(b64_json: str) -> Image.Image:
    data = base64.b64decode(b64_json)
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def _error(response: httpx.Response, status: int, param: str | None = "") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    if param != "":
        assert body["error"]["param"] == param, body
    return body["error"]


# -- images ------------------------------------------------------------------------------
def test_images_come_back_as_openai_shapes_them(flux_app):
    body = {"prompt": "a red fox", "size": "64x48", "n": 2, "seed": 7,
            "num_inference_steps": 3}
    r = call(flux_app, "POST", GEN, json=body)
    assert r.status_code == 200, r.text
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    doc = r.json()
    assert set(doc) == {"created", "data", "output_format", "size", "diffrt"}
    assert doc["output_format"] == "png" and doc["size"] == "64x48"
    assert len(doc["data"]) == 2
    images = [_png(d["b64_json"]) for d in doc["data"]]
    assert all(im.size == (64, 48) and im.format == "PNG" for im in images)
    assert images[0].tobytes() != images[1].tobytes()  # two images, not one twice
    info = doc["diffrt"]
    assert info["seed"] == 7 and info["num_inference_steps"] == 3
    assert info["request_id"] == r.headers["x-request-id"]
    assert info["timings"]["inference"] > 0 and info["timings"]["total"] > 0
    again = call(flux_app, "POST", GEN, json=body).json()
    assert [d["b64_json"] for d in again["data"]] == [d["b64_json"] for d in doc["data"]]
    other = call(flux_app, "POST", GEN, json={**body, "seed": 8}).json()
    assert other["data"][0]["b64_json"] != doc["data"][0]["b64_json"]


def test_size_auto_is_the_models_default_and_a_seed_is_drawn(flux_app):
    doc = call(flux_app, "POST", GEN, json={"prompt": "x", "num_inference_steps": 2}).json()
    assert doc["size"] == "128x128"  # tiny-flux's default
    assert isinstance(doc["diffrt"]["seed"], int)


def test_output_formats(flux_app):
    base = {"prompt": "a red fox", "size": "64x64", "seed": 1, "num_inference_steps": 2}
    sizes = {}
    for fmt, compression in [("jpeg", 100), ("jpeg", 10), ("webp", 80)]:
        r = call(flux_app, "POST", GEN, json={**base, "output_format": fmt,
                                               "output_compression": compression})
        doc = r.json()
        assert doc["output_format"] == fmt
        image = _png(doc["data"][0]["b64_json"])
        assert image.format == fmt.upper() and image.size == (64, 64)
        sizes[fmt, compression] = len(doc["data"][0]["b64_json"])
    assert sizes["jpeg", 10] < sizes["jpeg", 100]


def test_url_responses_are_served_then_expire(flux_app):
    r = call(flux_app, "POST", GEN, json={"prompt": "x", "size": "64x64",
                                         "num_inference_steps": 2, "response_format": "url"})
    url = r.json()["data"][0]["url"]
    assert url.startswith("/v1/images/") and url.endswith("/content")  # relative: no Host
    image = call(flux_app, "GET", url)
    assert image.status_code == 200 and image.headers["content-type"] == "image/png"
    assert Image.open(io.BytesIO(image.content)).size == (64, 64)
    _error(call(flux_app, "GET", "/v1/images/nope/content"), 404, "image_id")
    # no key needed: the random id is the credential (the URL works in an <img>)
    assert call(flux_app, "GET", url, headers={}).status_code == 200


def test_the_image_store_is_bounded_in_time_and_count():
    now = [0.0]
    store = ImageStore(ttl_s=10, max_images=2, clock=lambda: now[0])
    a = store.put(b"a", "image/png")
    now[0] = 5
    b = store.put(b"b", "image/png")
    with pytest.raises(StoreFull):  # a third: refused, nothing evicted
        store.put(b"c", "image/png")
    assert store.get(a) == (b"a", "image/png") and store.get(b) and len(store) == 2
    now[0] = 15.5  # both expired
    assert store.get(b) is None and len(store) == 0


# -- refusals --------------------------------------------------------------------------
REFUSALS = [
    ({"prompt": "x", "bogus": 1}, 400, "bogus", "unknown field"),
    ({"size": "64x64"}, 400, "prompt", "required"),
    ({"prompt": ""}, 400, "prompt", ""),
    ({"prompt": "x", "size": "big"}, 400, "size", "WxH"),
    ({"prompt": "x", "size": "65x64"}, 400, "size", "multiple of 16"),
    ({"prompt": "x", "size": "4096x4096"}, 400, "size", ""),
    ({"prompt": "x", "n": 17}, 400, "n", ""),  # the engine's limit, declared once
    ({"prompt": "x", "n": 0}, 400, "n", ""),
    ({"prompt": "x", "n": "2"}, 400, "n", ""),  # strict: no strings for numbers
    ({"prompt": "x", "stream": True, "n": 2}, 400, "n", "stream"),
    ({"prompt": "x", "partial_images": 4}, 400, "partial_images", ""),
    ({"prompt": "x", "output_format": "gif"}, 400, "output_format", ""),
    ({"prompt": "x", "seed": 2**64}, 400, "seed", ""),
    ({"prompt": "x", "num_inference_steps": 0}, 400, "num_inference_steps", ""),
    ({"prompt": "x", "model": "other"}, 404, "model", "does not make images here"),
    ({"prompt": "x", "size": "2048x2048", "num_inference_steps": 1000}, 400, "size",
     "max_request_seconds"),
]


@pytest.mark.parametrize(("body", "status", "param", "needle"), REFUSALS,
                         ids=[str(i) for i in range(len(REFUSALS))])
def test_bad_requests_are_refused_naming_the_field(flux_app, body, status, param, needle):
    error = _error(call(flux_app, "POST", GEN, json=body), status, param)
    assert needle in error["message"]


def test_openais_other_fields_are_accepted_and_ignored(flux_app):
    body = {"prompt": "x", "size": "64x64", "num_inference_steps": 2, "quality": "hd",
            "background": "opaque", "moderation": "low", "style": "vivid", "user": "u1",
            "model": "tiny-flux"}
    assert call(flux_app, "POST", GEN, json=body).status_code == 200


def test_bodies_that_are_not_json_objects(flux_app):
    for content in (b"not json", b"[1, 2]", b'"x"'):
        _error(call(flux_app, "POST", GEN, content=content,
                    headers={**AUTH, "content-type": "application/json"}), 400)


def test_the_body_size_is_limited(toy_app):
    app = toy_app(ServeSettings(api_key=API_KEY, max_body_bytes=1000))
    big = json.dumps({"prompt": "x" * 2000}).encode()
    _error(call(app, "POST", GEN, content=big,
                headers={**AUTH, "content-type": "application/json"}), 413)

    async def chunks():  # no Content-Length: counted as it arrives
        yield big[:600]
        yield big[600:]

    _error(call(app, "POST", GEN, content=chunks(),
                headers={**AUTH, "content-type": "application/json"}), 413)


def test_the_api_key_guards_v1_only(flux_app):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        _error(call(flux_app, "POST", GEN, json={"prompt": "x"}, headers=headers), 401, None)
        _error(call(flux_app, "GET", "/v1/models", headers=headers), 401, None)
    for path in ("/health", "/ready", "/metrics"):
        assert call(flux_app, "GET", path, headers={}).status_code == 200


def test_models_lists_the_served_model(flux_app):
    doc = call(flux_app, "GET", "/v1/models").json()
    assert doc["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in doc["data"]] == [
        ("tiny-flux", "model", "diffrt")]
    info = doc["data"][0]["diffrt"]  # the model's spec: what a request may ask
    assert (info["family"], info["tasks"], info["max_size"], info["size_multiple"]) == (
        "flux", ["text-to-image", "image-to-image", "inpainting"], 2048, 16)
    assert info["max_input_images"] == 1  # what /v1/images/edits may send it
    assert info["defaults"]["num_inference_steps"] == 4 and info["cfg_rule"] == (
        "true_cfg_and_negative")


def test_request_mode_refuses_previews_and_progress(toy_app):
    app = toy_app(step_execution=False)
    for field in ("partial_images", "stream_progress"):
        value = 1 if field == "partial_images" else True
        error = _error(call(app, "POST", GEN, json={"prompt": "x", "stream": True,
                                                     field: value}), 400, field)
        assert "step_execution" in error["message"]  # one rule, the engine's
    # not streamed: no previews could be shown, and REQUEST_BATCH still refuses them
    error = _error(call(app, "POST", GEN, json={"prompt": "x", "partial_images": 1}), 400,
                   "partial_images")
    assert "step_execution" in error["message"]


# -- streams ----------------------------------------------------------------------------
def test_a_stream_sends_previews_then_the_image(flux_app):
    r = call(flux_app, "POST", GEN, json={
        "prompt": "a red fox", "size": "64x64", "stream": True, "partial_images": 2,
        "num_inference_steps": 6, "stream_progress": True, "seed": 3})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    kinds = [e for e, _ in events]
    assert kinds[-1] == "image_generation.completed"
    partial = [d for e, d in events if e == "image_generation.partial_image"]
    assert [d["partial_image_index"] for d in partial] == [0, 1]
    assert kinds.count("diffrt.progress") == 5  # steps 1..5; the 6th is the image
    for event, data in events:
        assert data["type"] == event
    done = events[-1][1]
    assert _png(done["b64_json"]).size == (64, 64) and done["size"] == "64x64"
    assert all(_png(d["b64_json"]).size == (64, 64) for d in partial)
    # the streamed image is the one a plain request gives
    plain = call(flux_app, "POST", GEN, json={"prompt": "a red fox", "size": "64x64",
                                               "num_inference_steps": 6, "seed": 3}).json()
    assert plain["data"][0]["b64_json"] == done["b64_json"]


def test_a_failing_stream_ends_with_an_error_event(toy_app):
    app = toy_app()
    body = {"stream": True, "size": "16x16", "num_inference_steps": 2}
    # failing before its first output: an HTTP error, not a 200
    _error(call(app, "POST", GEN, json={"prompt": "fail", **body}), 500, None)
    # failing after it (its decode fails): the stream ends with an error event
    r = call(app, "POST", GEN, json={"prompt": "faildecode", "stream_progress": True, **body})
    assert r.status_code == 200
    events = _events(r.text)
    assert events[0][0] == "diffrt.progress"
    event, data = events[-1]
    assert event == "error" and data["error"]["type"] == "server_error"
    assert "generation failed" in data["error"]["message"]


# -- engine outcomes -----------------------------------------------------------------------
def test_a_failed_generation_is_500_and_a_timeout_504(toy_app):
    app = toy_app(request_timeout_s=1.0)  # "fail" must fail within it, even on a busy machine
    body = {"size": "16x16", "num_inference_steps": 2}
    error = _error(call(app, "POST", GEN, json={"prompt": "fail", **body}), 500, None)
    assert error["code"] == "generation_failed"
    engine_toy.gate("slow").clear()
    error = _error(call(app, "POST", GEN, json={"prompt": "block:slow", **body}), 504, None)
    assert "request_timeout_s=1" in error["message"]
    engine_toy.gate("slow").set()


def test_overload_is_429_with_retry_after(toy_app):
    app = toy_app(ServeSettings(api_key=API_KEY, max_pending=1, retry_after_s=3))
    engine_toy.gate("hold").clear()
    body = {"size": "16x16", "num_inference_steps": 2}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     headers=AUTH) as c:
            engine = app.state.client.engine

            async def until(running: int, waiting: int) -> None:
                for _ in range(250):
                    stats = engine.stats()
                    if (stats.requests_running, stats.requests_waiting) == (running, waiting):
                        return
                    await asyncio.sleep(0.02)
                raise AssertionError(f"never {running} running, {waiting} waiting")

            running = asyncio.create_task(c.post(GEN, json={"prompt": "block:hold", **body}))
            await until(1, 0)
            waiting = asyncio.create_task(c.post(GEN, json={"prompt": "p", **body}))
            await until(1, 1)
            refused = await c.post(GEN, json={"prompt": "p", **body})
            refused_stream = await c.post(GEN, json={"prompt": "p", "stream": True, **body})
            engine_toy.gate("hold").set()
            return refused, refused_stream, await running, await waiting

    refused, refused_stream, running, waiting = asyncio.run(main())
    for response in (refused, refused_stream):  # a stream too: a status, not an event
        error = _error(response, 429, None)
        assert int(response.headers["retry-after"]) >= 3  # --retry-after-s, the least said
        assert error["code"] == "rate_limit_exceeded"
    assert running.status_code == waiting.status_code == 200


def test_during_a_restart_requests_wait_for_the_fresh_workers_or_get_503(toy_app, monkeypatch):
    """While fresh workers start, /health stays 503 and a request waits for
    them: served (200) once they are; one whose wait ends first (here its own
    timeout_ms) is 503 ``engine_restarting`` with Retry-After, a stream too."""
    app = toy_app(restart_workers=True)
    engine = app.state.client.engine
    gate = hold_restarts(monkeypatch)
    kill_executor(engine.executor)
    body = {"size": "16x16", "num_inference_steps": 2}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     headers=AUTH) as c:
            health = (await c.get("/health")).status_code
            refused = await c.post(GEN, json={"prompt": "p", "timeout_ms": 200, **body})
            refused_stream = await c.post(GEN, json={"prompt": "p", "timeout_ms": 200,
                                                     "stream": True, **body})
            held = asyncio.create_task(c.post(GEN, json={"prompt": "p", **body}))
            await wait_for(lambda: engine.stats().requests_waiting == 1)
            health_held = (await c.get("/health")).status_code
            gate.set()
            return health, refused, refused_stream, health_held, await held

    health, refused, refused_stream, health_held, served = asyncio.run(main())
    assert health == health_held == 503
    for response in (refused, refused_stream):
        error = _error(response, 503, None)
        assert error["code"] == "engine_restarting" and "restarting" in error["message"]
        assert response.headers["retry-after"] == "5"
    assert served.status_code == 200, served.text
    assert wait_until(lambda: call(app, "GET", "/health").status_code == 200)


def test_states_answer_on_health_and_ready(toy_app):
    app = toy_app()
    client = app.state.client
    assert call(app, "GET", "/ready").status_code == 200
    client.state = "starting"
    assert call(app, "GET", "/ready").json() == {"status": "unavailable", "state": "starting"}
    assert call(app, "GET", "/health").status_code == 200  # loading is not dead
    _error(call(app, "POST", GEN, json={"prompt": "x"}), 503, None)
    client.state = "draining"
    assert call(app, "GET", "/ready").status_code == 503
    assert _error(call(app, "POST", GEN, json={"prompt": "x"}), 503)["code"] == "shutting_down"
    client.state = "ready"
    client.engine.close()  # the engine dies
    assert call(app, "GET", "/health").status_code == 503
    assert call(app, "GET", "/ready").status_code == 503
    assert _error(call(app, "POST", GEN, json={"prompt": "x"}), 503)["code"] == "engine_down"


def test_a_stalled_worker_turns_health_503_until_it_makes_progress(toy_app):
    """A worker call that makes no progress for stall_timeout_s (here a step
    held in the worker) turns /health and /ready 503, saying why, within
    seconds, and back to 200 once the step goes on; the request is served."""
    from waiting import wait_for

    app = toy_app(stall_timeout_s=0.3)
    engine = app.state.client.engine
    engine_toy.gate("stall").clear()
    body = {"prompt": "block:stall", "size": "16x16", "num_inference_steps": 2}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     headers=AUTH) as c:
            assert (await c.get("/health")).status_code == 200
            task = asyncio.create_task(c.post(GEN, json=body))
            await wait_for(lambda: engine.stats().requests_running == 1)
            give_up = time.monotonic() + 60  # bounded, generously for a busy machine
            while (health := await c.get("/health")).status_code != 503:
                if time.monotonic() > give_up:
                    break
                await asyncio.sleep(0.02)
            ready = await c.get("/ready")
            metrics = (await c.get("/metrics")).text
            engine_toy.gate("stall").set()
            answer = await task
            after = await c.get("/health")
            return health, ready, metrics, answer, after, await c.get("/ready")

    health, ready, metrics, answer, after, ready_after = asyncio.run(main())
    assert health.status_code == 503, health.text
    assert health.json()["status"] == "stalled" and health.json()["state"] == "ready"
    assert re.fullmatch(r"no progress for \d+ s \(stall_timeout_s=0.3\)",
                        health.json()["reason"]), health.json()
    assert ready.status_code == 503 and "no progress" in ready.json()["reason"]
    idle = float(re.search(r"^diffrt_seconds_without_progress (\S+)$", metrics, re.M).group(1))
    assert idle > 0.3
    assert answer.status_code == 200  # only reported: nothing was killed
    # (other keys, such as vendor import details, depend on the process)
    assert after.status_code == 200
    assert (after.json()["status"], after.json()["state"]) == ("ok", "ready")
    assert ready_after.status_code == 200
    assert engine.stats().worker_restarts == 0


def test_a_drain_lets_requests_finish_then_aborts_the_rest(toy_app):
    """A request in flight when the drain starts finishes if it can within the
    timeout; one that cannot is aborted at its next step boundary and answered
    503; a request after the drain began is refused."""
    body = {"size": "16x16", "num_inference_steps": 2}

    async def scenario(app, gate: str, timeout_s: float, open_after_s: float):
        client = app.state.client
        engine_toy.gate(gate).clear()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     headers=AUTH) as c:
            task = asyncio.create_task(c.post(GEN, json={"prompt": f"block:{gate}", **body}))
            for _ in range(250):
                if client.engine.stats().requests_running == 1:
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("the request never ran")
            loop = asyncio.get_running_loop()
            loop.call_later(open_after_s, engine_toy.gate(gate).set)  # the step ends then
            await client.drain(timeout_s)
            late = await c.post(GEN, json={"prompt": "p", **body})
            return await task, late

    finished, late = asyncio.run(scenario(toy_app(), "slow-step", 5.0, 0.2))
    assert finished.status_code == 200
    assert _error(late, 503)["code"] == "shutting_down"
    app = toy_app()
    aborted, _ = asyncio.run(scenario(app, "stuck-step", 0.2, 0.6))
    assert _error(aborted, 503)["code"] == "shutting_down"
    assert app.state.client.engine.stats().requests_total["aborted"] == 1


def test_an_unexpected_error_is_still_an_openai_500_with_an_id(toy_app, monkeypatch):
    from diffrt.serve import routes

    app = toy_app()

    def broken(body, request_id, **kw):
        raise RuntimeError("a bug")

    monkeypatch.setattr(routes, "to_engine_request", broken)
    r = call(app, "POST", GEN, json={"prompt": "x"})
    error = _error(r, 500, None)
    assert "RuntimeError" in error["message"]
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])


# -- metrics ----------------------------------------------------------------------------
def test_metrics_are_prometheus_text(flux_app):
    call(flux_app, "POST", GEN, json={"prompt": "x", "size": "64x64", "num_inference_steps": 2})
    text = call(flux_app, "GET", "/metrics", headers={}).text
    for name in ("diffrt_requests_running", "diffrt_requests_waiting",
                 'diffrt_requests_total{outcome="success"}',
                 'diffrt_request_latency_seconds_bucket{le="+Inf"}',
                 "diffrt_queue_wait_seconds_count", "diffrt_step_seconds_sum",
                 "diffrt_output_wait_seconds_bucket", "diffrt_prompts_encoded_total",
                 "diffrt_prompt_cache_hits_total", 'diffrt_http_responses_total{code="200"}',
                 'diffrt_step_batch_rows_bucket{le="1.0"}', "diffrt_step_batch_tokens_sum"):
        assert name in text, name
    buckets = [float(v) for v in re.findall(
        r'^diffrt_request_latency_seconds_bucket\{le="[^"]+"\} (\S+)$', text, re.M)]
    assert buckets == sorted(buckets) and buckets[-1] >= 1  # cumulative
