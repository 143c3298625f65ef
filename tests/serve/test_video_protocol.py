"""The videos API's bodies (``serve/video_protocol.py``): what the ``openai``
client sends is taken (multipart text leniently, JSON strictly), diffrt's
fields sit beside OpenAI's, a bad one is refused in OpenAI's error shape
naming it (through the server's own error handlers, on a test-only app:
the /v1/videos routes come with the video families), and the job objects
the store makes are OpenAI's."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from openai.types import Video, VideoDeleteResponse

from diffrt.serve.errors import install_error_handlers
from diffrt.serve.protocol import SAMPLING_FIELDS
from diffrt.serve.video_disk import FILE_KINDS
from diffrt.serve.video_jobs import VARIANTS, VideoError, VideoJob
from diffrt.serve.video_protocol import (
    VIDEO_FIELDS,
    VideoContentQuery,
    VideoCreateRequest,
    VideoDeleted,
    VideoList,
    VideoListQuery,
    VideoObject,
    VideoRemixRequest,
    read_video_fields,
)


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/json")
    async def json_body(request: Request) -> dict[str, Any]:
        return read_video_fields(await request.json(), form=False).model_dump()

    @app.post("/form")
    async def form_body(request: Request) -> dict[str, Any]:
        return read_video_fields(await request.json(), form=True).model_dump()

    return app


def post(path: str, body: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(path, json=body)
    return asyncio.run(go())


def refused(path: str, body: Any) -> dict[str, Any]:
    response = post(path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    return error


def test_openais_fields_and_diffrts_beside_them() -> None:
    body = read_video_fields({
        "prompt": "a fox", "model": "tiny-wan", "seconds": "2", "size": "832x480",
        "input_reference": {"image_url": "data:image/png;base64,AAAA"},
        "seed": 3, "num_inference_steps": 4, "guidance_scale": 5.0, "negative_prompt": "blur",
        "fps": 16.0, "priority": 1, "cache": "off", "loras": {"style": 0.5}}, form=False)
    assert (body.prompt, body.model, body.seconds, body.size) == ("a fox", "tiny-wan", "2",
                                                                  "832x480")
    assert body.input_reference == {"image_url": "data:image/png;base64,AAAA"}
    assert (body.seed, body.num_inference_steps, body.guidance_scale) == (3, 4, 5.0)
    assert (body.negative_prompt, body.fps, body.num_frames) == ("blur", 16.0, None)
    assert (body.priority, body.cache, body.loras) == (1, "off", {"style": 0.5})
    defaults = read_video_fields({"prompt": "x"}, form=False)
    assert (defaults.seconds, defaults.size, defaults.num_frames, defaults.seed) == (
        None, None, None, None)


def test_the_sampling_fields_are_the_declared_ones_a_clip_takes() -> None:
    names = {f.http for f in VIDEO_FIELDS}
    assert names == {f.http for f in SAMPLING_FIELDS} - {"n", "partial_images", "strength"}
    assert names <= set(VideoCreateRequest.model_fields)


def test_a_form_is_read_leniently_as_the_openai_client_sends_it() -> None:
    body = read_video_fields({"prompt": "a fox", "seconds": "4", "seed": "7", "fps": "24",
                              "num_inference_steps": "3", "loras": {"style": "0.8"},
                              "input_reference": {"image_url": "data:image/png;base64,AA"}},
                             form=True)
    assert (body.seconds, body.seed, body.fps, body.num_inference_steps) == ("4", 7, 24.0, 3)
    assert body.loras == {"style": 0.8}
    assert read_video_fields({"prompt": "x", "num_frames": "17"}, form=True).num_frames == 17


def test_seconds_takes_the_models_values_as_text_or_a_number() -> None:
    for given, kept in (("4", "4"), ("2.5", "2.5"), (3, "3"), (1.5, "1.5")):
        assert read_video_fields({"prompt": "x", "seconds": given}, form=False).seconds == kept


@pytest.mark.parametrize("body, param, says", [
    ({"prompt": "x", "seconds": "four"}, "seconds", 'must be a number of seconds, e.g. "4"'),
    ({"prompt": "x", "seconds": "0"}, "seconds", "must be > 0"),
    ({"prompt": "x", "seconds": "nan"}, "seconds", "must be > 0"),
    ({"prompt": "x", "seconds": True}, "seconds", "must be a number of seconds"),
    ({"prompt": "x", "size": "big"}, "size", 'must be "WxH" in pixels'),
    ({"prompt": "x", "size": "64x"}, "size", 'must be "WxH" in pixels'),
    ({"prompt": "x", "size": "６４x64"}, "size", 'must be "WxH" in pixels'),
    ({"prompt": "x", "seconds": "2", "num_frames": 17}, "num_frames",
     "give seconds or num_frames, not both"),
    ({"prompt": "x", "num_frames": 0}, "num_frames", "greater than or equal to 1"),
    ({"prompt": "x", "num_frames": 5000}, "num_frames", "less than or equal to 1025"),
    ({"prompt": "x", "fps": 0}, "fps", "greater than 0"),
    ({"prompt": "x", "seed": "3"}, "seed", "valid integer"),          # JSON is strict
    ({"prompt": "x", "n": 2}, None, "unknown field 'n'"),
    # an edit's field is unknown here (the generation route points it at the edits')
    ({"prompt": "x", "strength": 0.5}, None, "unknown field 'strength'"),
    ({"prompt": "x", "input_reference": {"file_id": "file-1"}}, "input_reference",
     "file ids are not served here"),
    ({"prompt": "x", "input_reference": 5}, "input_reference", "must be a data: URL"),
    ({"prompt": "x", "input_reference": {"image_url": "data:,", "x": 1}}, "input_reference",
     "must be a data: URL"),
    ({"prompt": ""}, "prompt", "at least 1 character"),
    ({"seconds": "4"}, "prompt", "prompt: required"),
])
def test_a_bad_field_is_refused_in_openais_shape_naming_it(body, param, says) -> None:
    error = refused("/json", body)
    assert says in error["message"], error
    if param is not None:
        assert error["message"].startswith(f"{param}: ")
        assert error["param"] == param
    assert error["code"] == "invalid_value"


def test_a_bad_form_field_is_refused_the_same_way() -> None:
    error = refused("/form", {"prompt": "x", "num_frames": "many"})
    assert error["param"] == "num_frames" and "valid integer" in error["message"]
    error = refused("/form", {"prompt": "x", "seconds": "-1"})
    assert (error["param"], error["message"]) == ("seconds", "seconds: must be > 0 and <= "
                                                             "3600, got -1")


def test_the_refusal_is_fastapis_validation_error() -> None:
    with pytest.raises(RequestValidationError):
        read_video_fields({"prompt": "x", "size": "1"}, form=True)


def test_the_other_bodies() -> None:
    assert VideoRemixRequest(prompt="again").prompt == "again"
    with pytest.raises(ValueError):
        VideoRemixRequest.model_validate({"prompt": "a", "seed": 1})
    query = VideoListQuery()
    assert (query.after, query.limit, query.order) == (None, 20, "desc")
    with pytest.raises(ValueError):
        VideoListQuery(limit=101)
    with pytest.raises(ValueError):
        VideoListQuery.model_validate({"order": "newest"})
    assert VideoContentQuery().variant == "video"
    with pytest.raises(ValueError):
        VideoContentQuery.model_validate({"variant": "gif"})
    assert set(VARIANTS) == set(FILE_KINDS)                       # every variant has a file kind
    deleted = VideoDeleted(id="video_x").model_dump()
    assert VideoDeleteResponse.model_validate(deleted).deleted is True


def test_the_stores_jobs_are_openais_video_objects() -> None:
    job = VideoJob(id="video_" + "a" * 32, status="failed", created_at=1, completed_at=2,
                   expires_s=3602.5, model="tiny-wan", seconds="2", size="1280x720",
                   prompt="p", error=VideoError("server_restarted", "restarted"))
    shown = VideoObject.model_validate(job.public())
    assert set(shown.model_dump()) == set(Video.model_fields)
    client_view = Video.model_validate(shown.model_dump())
    assert (client_view.status, client_view.expires_at) == ("failed", 3602)
    assert client_view.error is not None and client_view.error.code == "server_restarted"
    page = VideoList(data=[shown], first_id=job.id, last_id=job.id, has_more=False)
    assert page.model_dump()["object"] == "list"
