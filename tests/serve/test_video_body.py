"""The body of ``POST /v1/videos`` as clients send it (``serve/video_body.py``):
the ``openai`` client's multipart form (a file or a URL for the first frame,
``extra_body`` fields beside OpenAI's), JSON, an HTML form; refusals naming
the field. On a test-only app that answers with what it read (the
/v1/videos routes come with the video families)."""

from __future__ import annotations

import asyncio
import io
from typing import Any

import httpx
import openai
import PIL.Image
import pytest
from fastapi import FastAPI, Request

from diffrt.serve.errors import install_error_handlers
from diffrt.serve.video_body import read_video_body

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # openai marks Sora's API


def _app(seen: list[Any]) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/videos")
    async def create(request: Request) -> dict[str, Any]:
        body, reference = await read_video_body(request)
        seen.append((body, reference))
        return {"id": "video_" + "0" * 32, "object": "video", "status": "queued",
                "progress": 0, "created_at": 1, "model": body.model or "m",
                "seconds": body.seconds or "1", "size": body.size or "64x64",
                "prompt": body.prompt}

    return app


def _png() -> bytes:
    buffer = io.BytesIO()
    PIL.Image.new("RGB", (8, 8), (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


async def _with_openai(call: Any) -> list[Any]:
    seen: list[Any] = []
    transport = httpx.ASGITransport(app=_app(seen))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=http)
        await call(client)
    return seen


async def _post(seen: list[Any], **kwargs: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=_app(seen))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        return await http.post("/v1/videos", **kwargs)


def post(seen: list[Any] | None = None, **kwargs: Any) -> httpx.Response:
    return asyncio.run(_post([] if seen is None else seen, **kwargs))


def test_the_openai_clients_form_with_a_file_and_extra_fields() -> None:
    png = _png()

    async def create(client: openai.AsyncOpenAI) -> None:
        video = await client.videos.create(
            prompt="a fox", model="tiny-wan", seconds="2", size="64x64",
            input_reference=("first.png", png, "image/png"),
            extra_body={"seed": 3, "num_inference_steps": 4, "fps": 8,
                        "negative_prompt": "blur", "loras": {"style": 0.5}})
        assert video.status == "queued" and video.prompt == "a fox"

    [(body, reference)] = asyncio.run(_with_openai(create))
    assert (body.prompt, body.model, body.seconds, body.size) == ("a fox", "tiny-wan", "2",
                                                                  "64x64")
    assert (body.seed, body.num_inference_steps, body.fps) == (3, 4, 8.0)
    assert (body.negative_prompt, body.loras) == ("blur", {"style": 0.5})
    assert reference == png and body.input_reference is None


def test_a_url_reference_in_a_form_and_none() -> None:
    # the openai client (3.x) sends only files as input_reference; other clients
    # may send OpenAI's {"image_url": ...} as form text, input_reference[image_url]
    seen: list[Any] = []
    answer = post(seen, files={"prompt": (None, "a fox"),
                               "input_reference[image_url]": (None, "data:image/png;base64,AA")})
    assert answer.status_code == 200, answer.text
    [(body, reference)] = seen
    assert reference == "data:image/png;base64,AA" and body.input_reference is None
    [(body, reference)] = asyncio.run(_with_openai(
        lambda client: client.videos.create(prompt="no frame")))
    assert (body.prompt, reference, body.seconds) == ("no frame", None, None)


def test_json_and_html_forms() -> None:
    seen: list[Any] = []
    assert post(seen, json={"prompt": "j", "seed": 5,
                            "input_reference": "data:image/png;base64,A"}).status_code == 200
    assert post(seen, data={"prompt": "h", "num_frames": "17"}).status_code == 200
    (json_body, json_reference), (form_body, form_reference) = seen
    assert (json_body.seed, json_reference) == (5, "data:image/png;base64,A")
    assert (form_body.num_frames, form_reference) == (17, None)


@pytest.mark.parametrize("kwargs, status, param, says", [
    ({"json": {"prompt": "x", "seed": "5"}}, 400, "seed", "valid integer"),
    ({"data": {"prompt": "x", "size": "wide"}}, 400, "size", 'must be "WxH"'),
    ({"files": {"prompt": (None, "x"), "input_reference": ("a.png", b"1", "image/png"),
                "input_reference[image_url]": (None, "data:,")}}, 400, "input_reference",
     "not both"),
    ({"files": [("prompt", (None, "x")), ("input_reference", ("a.png", b"1", "image/png")),
                ("input_reference", ("b.png", b"2", "image/png"))]}, 400, "input_reference",
     "give one image"),
    ({"files": {"prompt": ("p.txt", b"x", "text/plain")}}, 400, "prompt",
     "a file where a text field belongs"),
    ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 400, None,
     "not valid JSON"),
    ({"content": b"x", "headers": {"content-type": "text/plain"}}, 415, None,
     "multipart/form-data, application/json"),
])
def test_refusals_name_the_field(kwargs, status, param, says) -> None:
    answer = post(**kwargs)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert says in error["message"] and error["param"] == param, error
