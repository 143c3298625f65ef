"""A real ``diffrt serve`` process (worker processes, sockets on 127.0.0.1)
and real clients: the official ``openai`` client, concurrent httpx clients
that disconnect, schemathesis over the published OpenAPI schema. The server is
the session's shared one (``real_server`` in conftest.py); schemathesis has its
twin with a cost limit (``costed_server``)."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from PIL import Image
from serve_helpers import API_KEY, AUTH
from shape_checks import SCENES, assert_drawn

from diffrt.engine import EngineConfig
from diffrt.serve import ServeSettings, build_app

pytestmark = pytest.mark.e2e

GEN = "/v1/images/generations"


def _png(b64_json: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64_json)))
    image.load()
    return image


#: the image engine's series: the shared server also runs diffrt-motion, and
#: every engine series carries its engine's model
IMAGES = {"engine": "diffrt-shapes"}


def _samples(metrics: str, name: str, **labels: str) -> list[float]:
    """The values of ``name``'s samples of the image engine with ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    want = {**IMAGES, **labels}
    return [sample.value for family in text_string_to_metric_families(metrics)
            for sample in family.samples
            if sample.name == name and want.items() <= sample.labels.items()]


def _requests_seen(metrics: str) -> float:
    """Requests the image engine has taken: those waiting or running, and those ended."""
    return sum(sum(_samples(metrics, name)) for name in (
        "diffrt_requests_total", "diffrt_requests_waiting", "diffrt_requests_running"))


def _metric(url: str, name: str, **labels: str) -> float:
    [value] = _samples(httpx.get(f"{url}/metrics", timeout=10).text, name, **labels)
    return value


def test_the_openai_client(real_server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{real_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    kw = dict(model="diffrt-shapes", prompt="a red fox", size="64x64", n=2,
              extra_body={"num_inference_steps": 4, "seed": 1})
    first = client.images.generate(**kw)
    assert len(first.data) == 2
    images = [_png(d.b64_json) for d in first.data]
    assert all(im.format == "PNG" and im.size == (64, 64) for im in images)
    assert first.model_extra["diffrt"]["seed"] == 1
    again = client.images.generate(**kw)
    assert [d.b64_json for d in again.data] == [d.b64_json for d in first.data]

    stream = client.images.generate(model="diffrt-shapes", prompt="a red fox", size="64x64",
                                    stream=True, partial_images=2,
                                    extra_body={"num_inference_steps": 6, "seed": 2})
    events = list(stream)
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + [
        "image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    assert _png(events[-1].b64_json).size == (64, 64)


def test_the_default_model_draws_the_prompts_over_http(real_server):
    """The served default model (diffrt-shapes, worker processes, step mode
    with eight requests at once) draws what the prompts say."""

    async def ask() -> list[Image.Image]:
        async with httpx.AsyncClient(base_url=real_server.url, headers=AUTH,
                                     timeout=120) as client:
            answers = await asyncio.gather(*(client.post(GEN, json={
                "prompt": scene.prompt, "seed": i}) for i, scene in enumerate(SCENES)))
        for r in answers:
            r.raise_for_status()
        return [_png(r.json()["data"][0]["b64_json"]) for r in answers]

    images = asyncio.run(ask())
    assert all(im.size == (64, 64) for im in images)  # the model's own default size
    assert_drawn(SCENES, images)


def test_disconnected_clients_free_their_requests(real_server):
    """32 concurrent requests; 8 clients leave mid-way (4 close their stream
    after its first event, 4 hang up while waiting for the image). The other
    24 get their images; the 8 are aborted in the engine; nothing is left."""
    aborted_before = _metric(real_server.url, "diffrt_requests_total", outcome="aborted")
    seen_before = _requests_seen(httpx.get(f"{real_server.url}/metrics", timeout=10).text)

    async def main():
        async with httpx.AsyncClient(base_url=real_server.url, headers=AUTH, timeout=600,
                                     limits=httpx.Limits(max_connections=64)) as c:
            all_in = asyncio.Event()

            async def watch() -> None:
                """Sets ``all_in`` once the server has taken all 32 (each waiting,
                running or done): a wait-leaver that left before its request
                reached the server would abort nothing."""
                give_up = asyncio.get_running_loop().time() + 300
                while _requests_seen((await c.get("/metrics")).text) - seen_before < 32:
                    assert asyncio.get_running_loop().time() < give_up, "the 32 never arrived"
                    await asyncio.sleep(0.05)
                all_in.set()

            async def stays(i: int) -> httpx.Response:
                return await c.post(GEN, json={"prompt": f"stay {i}", "size": "64x64",
                                               "num_inference_steps": 6, "seed": i})

            async def leaves_a_stream(i: int) -> None:
                # 300 guided steps (x2): seconds of work (the server has no
                # cost limit that a busy machine's slower steps could trip)
                body = {"prompt": f"leave {i}", "size": "32x32", "num_inference_steps": 300,
                        "stream": True, "stream_progress": True}
                async with c.stream("POST", GEN, json=body) as response:
                    assert response.status_code == 200, await response.aread()
                    async for line in response.aiter_lines():
                        if line.startswith("event: diffrt.progress"):
                            return  # mid-way: the connection closes with the stream

            async def leaves_a_wait(i: int) -> None:
                task = asyncio.create_task(c.post(GEN, json={
                    "prompt": f"leave {i}", "size": "32x32", "num_inference_steps": 300}))
                await all_in.wait()  # in the server (running or waiting: it runs for seconds)
                task.cancel()  # httpx closes the connection: the server sees a disconnect

            return await asyncio.gather(*[stays(i) for i in range(24)],
                                        *[leaves_a_stream(i) for i in range(4)],
                                        *[leaves_a_wait(i) for i in range(4)], watch())

    results = asyncio.run(main())
    for i, response in enumerate(results[:24]):
        assert response.status_code == 200, response.text
        doc = response.json()
        assert doc["diffrt"]["seed"] == i and _png(doc["data"][0]["b64_json"]).size == (64, 64)

    def settled() -> bool:
        return (_metric(real_server.url, "diffrt_requests_running") == 0
                and _metric(real_server.url, "diffrt_requests_waiting") == 0
                and _metric(real_server.url, "diffrt_pending_output_bytes") == 0)

    from waiting import wait_until

    assert wait_until(settled, timeout=300, interval=0.2)
    aborted = _metric(real_server.url, "diffrt_requests_total", outcome="aborted") - aborted_before
    assert aborted == 8


# -- schemathesis over the published schema -------------------------------------------------
def _schema():
    app = build_app(EngineConfig(model="tiny-flux", step_execution=True),
                    ServeSettings(api_key=API_KEY))
    return schemathesis.openapi.from_dict(app.openapi())


schema = _schema()


@schema.parametrize()
@pytest.mark.timeout(900)  # 25 examples, each admitted at about 5 s at most, on a busy machine
@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_the_api_holds_up_to_generated_requests(case, costed_server):
    # admitted: estimated within MAX_REQUEST_SECONDS at the load of the
    # moment; the generous timeout covers the load rising meanwhile
    response = case.call(base_url=costed_server.url, headers=AUTH, timeout=300)
    asked_to_time_out = isinstance(case.body, dict) and case.body.get("timeout_ms") is not None
    if response.status_code == 504 and asked_to_time_out:  # the client's own limit ran out
        assert response.json()["error"]["code"] == "timeout"
        return
    assert response.status_code < 500, (case.path, case.body, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, response.text
        assert isinstance(error["message"], str) and error["message"]
