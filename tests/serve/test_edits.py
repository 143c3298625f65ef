"""POST /v1/images/edits in-process (httpx's ASGI transport; tiny-flux on the
in-process executor, shared with the other server tests; the toy model for
a model that serves no edits): both body forms, the official ``openai``
client plain and streamed, every refusal, the mask conventions, 429 when
the engine's input arena is full."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image
from serve_helpers import API_KEY, AUTH, call
from waiting import wait_for

from diffrt.engine import DiffusionEngine, EngineConfig
from diffrt.engine.image_files import mask_for_engine
from diffrt.engine.sampling import InvalidRequestError
from diffrt.serve import ServeSettings, build_app

EDITS = "/v1/images/edits"
#: fast edits of tiny-flux (128x128 is its default size; 64x64 is quicker)
FAST = {"size": "64x64", "num_inference_steps": "4", "seed": "3"}


def _file(image: Image.Image, fmt: str = "PNG", **save) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **save)
    return out.getvalue()


def _data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def _picture(seed: int, size: tuple[int, int] = (64, 64)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _square_mask(size: tuple[int, int] = (64, 64)) -> Image.Image:
    """White (repaint) in the top-left quarter, black elsewhere: diffusers' convention."""
    mask = Image.new("L", size, 0)
    mask.paste(255, (0, 0, size[0] // 2, size[1] // 2))
    return mask


def _pixels(doc: dict, i: int = 0) -> np.ndarray:
    image = Image.open(io.BytesIO(base64.b64decode(doc["data"][i]["b64_json"])))
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def _error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text[:400]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param, error
    return error


def _edit(app, image: bytes | None = None, mask: bytes | None = None, **fields):
    files = []
    if image is not None:
        files.append(("image", ("in.png", image, "image/png")))
    if mask is not None:
        files.append(("mask", ("mask.png", mask, "image/png")))
    return call(app, "POST", EDITS, files=files,
                data={"prompt": "a red fox", **FAST, **fields})


# -- both forms, the openai client ---------------------------------------------------------
def test_multipart_and_json_bodies_make_the_same_edit(flux_app):
    image, mask = _file(_picture(1)), _file(_square_mask())
    form = _edit(flux_app, image, mask, strength="0.7")
    assert form.status_code == 200, form.text
    doc = form.json()
    assert doc["size"] == "64x64" and doc["diffrt"]["seed"] == 3
    as_json = call(flux_app, "POST", EDITS, json={
        "prompt": "a red fox", "size": "64x64", "num_inference_steps": 4, "seed": 3,
        "strength": 0.7, "images": [_data_url(image)], "mask": {"image_url": _data_url(mask)}})
    assert as_json.status_code == 200, as_json.text
    assert np.abs(_pixels(doc) - _pixels(as_json.json())).max() <= 1
    # the input matters: another picture, the same seed, another result
    other = _edit(flux_app, _file(_picture(2)), mask, strength="0.7").json()
    assert np.abs(_pixels(doc) - _pixels(other)).max() > 8


def test_an_edit_over_http_is_the_engines_own(flux_app, flux_step_engine):
    """The server decodes and converts the inputs before submission (off the
    event loop); the pixels are those of the same images given to the engine
    directly, at the request's size and at the model's default."""
    from diffrt.engine import DiffusionRequest, SamplingParams

    picture, mask = _picture(6, (96, 80)), _square_mask((96, 80))
    for size, height, width in (("64x64", 64, 64), ("auto", None, None)):
        over_http = _edit(flux_app, _file(picture), _file(mask), strength="0.8", size=size)
        assert over_http.status_code == 200, over_http.text[:300]
        direct = flux_step_engine.generate(DiffusionRequest(
            "a red fox", images=[picture], mask_image=mask,
            sampling_params=SamplingParams(height=height, width=width, seed=3,
                                           num_inference_steps=4, strength=0.8)))
        assert direct.ok, direct.error
        engine = np.asarray(direct.images[0].convert("RGB"), dtype=np.int16)
        assert np.abs(_pixels(over_http.json()) - engine).max() <= 1, size


def test_an_alpha_mask_edits_where_it_is_transparent(flux_app):
    """OpenAI's mask (alpha 0: edit here) gives the same edit as diffusers'
    mask (white: repaint) of the same region."""
    image = _file(_picture(4))
    white = _square_mask()
    alpha = Image.new("RGBA", (64, 64), (10, 20, 30, 255))
    alpha.paste((0, 0, 0, 0), (0, 0, 32, 32))
    by_white = _edit(flux_app, image, _file(white)).json()
    by_alpha = _edit(flux_app, image, _file(alpha)).json()
    assert np.abs(_pixels(by_white) - _pixels(by_alpha)).max() <= 1
    # a mask the other way round is another edit
    inverted = _edit(flux_app, image, _file(Image.eval(white, lambda v: 255 - v))).json()
    assert np.abs(_pixels(by_white) - _pixels(inverted)).max() > 8


def test_the_openai_client_edits_plain_and_streamed(flux_app):
    from openai import AsyncOpenAI

    image = ("in.png", _file(_picture(5)), "image/png")
    mask = ("mask.png", _file(_square_mask()), "image/png")
    extra = {"num_inference_steps": 8, "seed": 11, "strength": 0.75}

    async def main():
        transport = httpx.ASGITransport(app=flux_app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            client = AsyncOpenAI(base_url="http://testserver/v1", api_key=API_KEY,
                                 http_client=http, max_retries=0)
            plain = await client.images.edit(model="tiny-flux", image=image, mask=mask,
                                             prompt="a red fox", size="64x64", n=2,
                                             extra_body=extra)
            listed = await client.images.edit(image=[image], prompt="a red fox", size="64x64",
                                              extra_body=extra)  # sent as image[]
            stream = await client.images.edit(image=image, mask=mask, prompt="a red fox",
                                              size="64x64", stream=True, partial_images=2,
                                              extra_body=extra)
            events = [event async for event in stream]
            return plain, listed, events

    plain, listed, events = asyncio.run(main())
    assert len(plain.data) == 2 and plain.model_extra["diffrt"]["seed"] == 11
    # 0.75 of 8 steps: 6 denoise steps run (diffusers' int(steps * strength))
    assert plain.model_extra["diffrt"]["num_inference_steps"] == 6
    assert len(listed.data) == 1
    assert [e.type for e in events] == ["image_edit.partial_image"] * 2 + [
        "image_edit.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    final = Image.open(io.BytesIO(base64.b64decode(events[-1].b64_json)))
    assert final.size == (64, 64)
    # the stream's image is the plain request's first (same seed, same inputs)
    streamed = np.asarray(final.convert("RGB"), dtype=np.int16)
    first = np.asarray(Image.open(io.BytesIO(base64.b64decode(plain.data[0].b64_json)))
                       .convert("RGB"), dtype=np.int16)
    assert np.abs(streamed - first).max() <= 1


def test_form_fields_read_as_the_json_bodys_types(flux_app):
    # loras[name]=scale (how the openai client sends a mapping) reaches the engine's check
    error = _error(_edit(flux_app, _file(_picture(1)), **{"loras[style]": "0.5"}), 400, "loras")
    assert "style" in error["message"]
    _error(_edit(flux_app, _file(_picture(1)), n="two"), 400, "n")
    _error(_edit(flux_app, _file(_picture(1)), stream="maybe"), 400, "stream")
    _error(_edit(flux_app, _file(_picture(1)), colour="red"), 400, "colour")
    response = call(flux_app, "POST", EDITS, files=[
        ("image", ("in.png", _file(_picture(1)), "image/png"))],
        data={"prompt": "a", "seed": ["1", "2"]})
    _error(response, 400, "seed")  # a field given twice: which one was meant?


def test_an_image_may_come_as_a_data_url_text_part(flux_app):
    url = _data_url(_file(_picture(1)))
    as_text_part = call(flux_app, "POST", EDITS, files=[("image", (None, url))],
                        data={"prompt": "a red fox", **FAST})
    assert as_text_part.status_code == 200, as_text_part.text
    urlencoded = call(flux_app, "POST", EDITS, data={"prompt": "a red fox", **FAST,
                                                     "image": url})  # an HTML form's body
    assert urlencoded.status_code == 200, urlencoded.text
    assert urlencoded.json()["data"] == as_text_part.json()["data"]


def test_an_upright_image_is_what_its_exif_orientation_says(flux_app):
    """A JPEG stored 128x64 with EXIF orientation 6 (rotated 90 degrees) is a
    64x128 picture: a 64x128 mask fits it, a 128x64 one does not."""
    exif = Image.Exif()
    exif[0x0112] = 6
    photo = _file(_picture(7, (128, 64)), "JPEG", exif=exif.tobytes())
    tall, wide = _square_mask((64, 128)), _square_mask((128, 64))
    assert _edit(flux_app, photo, _file(tall)).status_code == 200
    error = _error(_edit(flux_app, photo, _file(wide)), 400, "mask")
    assert "128x64, the image it masks 64x128" in error["message"]


# -- refusals ------------------------------------------------------------------------------
def test_what_is_not_an_image_is_refused_naming_the_part(flux_app):
    error = _error(_edit(flux_app, b"GIF89a, or not"), 400, "image")
    assert "not an image file" in error["message"]
    _error(_edit(flux_app, _file(_picture(1)), b"\x89PNG\r\n\x1a\n cut short"), 400, "mask")
    truncated = _file(_picture(1))[:-200]
    assert "cannot be decoded" in _error(_edit(flux_app, truncated), 400, "image")["message"]
    tiff = _file(_picture(1), "TIFF")  # Pillow reads it; the server opens only its formats
    _error(_edit(flux_app, tiff), 400, "image")
    response = call(flux_app, "POST", EDITS, json={"prompt": "x", "images": [
        _data_url(_file(_picture(1))), "data:image/png;base64,bm90IGFuIGltYWdl"]})
    _error(response, 400, "images[1]")
    response = call(flux_app, "POST", EDITS, json={"prompt": "x", "images": ["data:,plain"]})
    assert "base64" in _error(response, 400, "images[0]")["message"]


def test_a_decompression_bomb_is_refused_from_its_header(flux_app):
    """4097x4097 of one colour is a PNG of a few kB that would decode to 50 MB."""
    bomb = _file(Image.new("L", (4097, 4097), 0), optimize=True)
    assert len(bomb) < 200_000
    error = _error(_edit(flux_app, bomb), 400, "image")
    assert "4097x4097 is more than 16777216 pixels" in error["message"]


def test_remote_urls_are_never_fetched(flux_app):
    for url in ("https://example.com/cat.png", "http://127.0.0.1:1/x.png"):
        response = call(flux_app, "POST", EDITS, json={"prompt": "x", "images": [url]})
        assert "not fetched" in _error(response, 400, "images[0]")["message"]
    response = call(flux_app, "POST", EDITS, json={
        "prompt": "x", "images": [_data_url(_file(_picture(1)))],
        "mask": {"image_url": "https://example.com/mask.png"}})
    _error(response, 400, "mask")
    response = call(flux_app, "POST", EDITS, json={"prompt": "x", "images": [{"file_id": "f"}]})
    _error(response, 400, "images[0]")
    response = call(flux_app, "POST", EDITS, data={"prompt": "x", "image": "https://e.com/c.png"})
    _error(response, 400, "image")


def test_a_mask_must_fit_its_image_and_needs_one(flux_app):
    image = _file(_picture(1))
    error = _error(_edit(flux_app, image, _file(_square_mask((32, 32)))), 400, "mask")
    assert "32x32" in error["message"] and "same size" in error["message"]
    assert "required" in _error(_edit(flux_app, None, _file(_square_mask())), 400,
                                "image")["message"]
    response = call(flux_app, "POST", EDITS, json={"prompt": "x", "images": [],
                                                   "mask": _data_url(_file(_square_mask()))})
    _error(response, 400, "images")
    opaque = Image.new("RGBA", (64, 64), (255, 255, 255, 255))  # alpha, nothing transparent
    assert "no fully transparent pixel" in _error(_edit(flux_app, image, _file(opaque)), 400,
                                                  "mask")["message"]


def test_strength_is_an_edits_field_in_its_range(flux_app):
    image = _file(_picture(1))
    for bad in ("0", "1.5", "nan"):
        _error(_edit(flux_app, image, strength=bad), 400, "strength")
    # a little of few steps still runs one (diffusers' rounding)
    few = _edit(flux_app, image, strength="0.1", num_inference_steps="2")
    assert few.json()["diffrt"]["num_inference_steps"] == 1
    error = _error(call(flux_app, "POST", "/v1/images/generations",
                        json={"prompt": "x", "strength": 0.5}), 400, "strength")
    assert "/v1/images/edits" in error["message"]


def test_too_many_images_are_refused(flux_app):
    image = ("image[]", ("in.png", _file(_picture(1)), "image/png"))
    response = call(flux_app, "POST", EDITS, files=[image, image], data={"prompt": "x", **FAST})
    assert "takes at most 1" in _error(response, 400, "image")["message"]  # tiny-flux: one
    response = call(flux_app, "POST", EDITS, files=[image] * 5, data={"prompt": "x"})
    assert "at most 4 images" in _error(response, 400, "image")["message"]  # before decoding
    response = call(flux_app, "POST", EDITS, json={"prompt": "x", "images": ["data:,"] * 5})
    _error(response, 400, "images")


def test_a_model_without_edits_refuses_them_by_task(toy_app):
    app = toy_app()
    image, mask = _file(_picture(1)), _file(_square_mask())
    error = _error(call(app, "POST", EDITS, files=[("image", ("a.png", image, "image/png"))],
                        data={"prompt": "x"}), 400, "image")
    assert "image-to-image is not a task of toy" in error["message"]
    error = _error(call(app, "POST", EDITS, files=[("image", ("a.png", image, "image/png")),
                                                   ("mask", ("m.png", mask, "image/png"))],
                        data={"prompt": "x"}), 400, "mask")
    assert "inpainting is not a task of toy" in error["message"]


def test_other_bodies_and_oversized_ones_are_refused():
    """415 for a body in neither form; an edit's body has its own bound
    (max_edit_body_bytes), above the generations' (max_body_bytes); none of
    these reaches an engine."""
    settings = ServeSettings(api_key=API_KEY, max_body_bytes=1000, max_edit_body_bytes=200_000)
    app = build_app(settings=settings, client=_StubClient(settings))
    response = call(app, "POST", EDITS, content=b"prompt=x",
                    headers={**AUTH, "content-type": "text/plain"})
    assert response.status_code == 415 and response.json()["error"]["code"] == (
        "unsupported_media_type")
    big = np.random.default_rng(0).integers(0, 256, (300, 300, 3), dtype=np.uint8)
    png = _file(Image.fromarray(big))
    assert 200_000 < len(png)
    response = call(app, "POST", EDITS, files=[("image", ("a.png", png, "image/png"))],
                    data={"prompt": "x"})
    assert response.status_code == 413, response.text
    # 5 kB: over the generations' bound, within the edits': read (and refused on its own terms)
    response = call(app, "POST", EDITS, files=[("image", ("a.png", b"x" * 5000, "image/png"))],
                    data={"prompt": "x"})
    _error(response, 400, "image")


class _StubClient:
    """The engine client's surface the app reads at start (no engine: the
    requests of these tests are refused before one would be asked)."""

    model_name = "stub"
    step_execution = True
    state = "ready"

    def __init__(self, settings):
        self.settings = settings

    async def start(self):
        return None

    async def drain(self, timeout_s):
        return None

    async def close(self):
        return None

    def metric_snapshots(self):
        return []

    def model_spec(self):
        return None


def test_edit_bodies_in_flight_share_a_budget(flux_app, flux_step_engine):
    """``max_edit_bytes_in_flight``: a body that does not fit is 429 with
    Retry-After; a body's room is given back once the route has read it into
    the engine's arrays, so an edit that waits for the engine holds none
    (a second edit arriving while the first runs is served)."""
    image = _file(_picture(9))
    files = [("image", ("in.png", image, "image/png"))]
    size = len(httpx.Request("POST", "http://x", files=files,
                             data={"prompt": "a red fox", **FAST}).read())
    tight = build_app(settings=ServeSettings(api_key=API_KEY,
                                             max_edit_bytes_in_flight=size * 3 // 2),
                      engine=flux_step_engine)
    response = call(tight, "POST", EDITS, files=files + [("mask", ("m.png", image, "image/png"))],
                    data={"prompt": "a red fox", **FAST})
    error = _error(response, 429, None)
    assert error["code"] == "uploads_full" and response.headers["retry-after"] == "1"

    async def two_at_once():
        transport = httpx.ASGITransport(app=tight)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver",
                                     headers=AUTH, timeout=120) as client:
            running = flux_step_engine.stats().requests_running
            slow = asyncio.create_task(client.post(EDITS, files=files, data={
                "prompt": "a red fox", **FAST, "size": "32x32", "num_inference_steps": "60"}))
            await wait_for(lambda: slow.done()
                           or flux_step_engine.stats().requests_running > running, timeout=60)
            assert not slow.done(), slow.result().text[:300]  # it runs, its body read
            second = await client.post(EDITS, files=files, data={"prompt": "a red fox", **FAST})
            assert not slow.done()  # it still ran while the second was read and served
            return await slow, second

    slow, second = asyncio.run(two_at_once())
    assert slow.status_code == 200 and second.status_code == 200, (slow.text, second.text)
    again = call(tight, "POST", EDITS, files=files, data={"prompt": "a red fox", **FAST})
    assert again.status_code == 200  # nothing left held


# -- the engine's input arena full: 429 ----------------------------------------------------
@pytest.fixture(scope="module")
def small_inputs_app():
    """tiny-flux with room for the inputs of about one 64x64 edit."""
    engine = DiffusionEngine.make_engine(EngineConfig(
        model="tiny-flux", executor_backend="inproc", step_execution=True, max_num_seqs=1,
        warmup=False, max_pending_input_bytes=64 << 10))
    try:
        yield build_app(settings=ServeSettings(api_key=API_KEY), engine=engine), engine
    finally:
        engine.close()


def test_a_full_input_arena_is_a_429_with_retry_after(small_inputs_app):
    app, engine = small_inputs_app
    image, mask = _file(_picture(1)), _file(_square_mask())
    # the inputs of requests the engine holds, standing in for one held long enough
    held = engine.inputs.put(np.zeros(engine.inputs.size - 8192, dtype=np.uint8))
    try:
        response = _edit(app, image, mask)
        error = _error(response, 429, None)
        assert error["code"] == "input_images_full" and error["type"] == "rate_limit_error"
        assert response.headers["retry-after"] == "1"
    finally:
        engine.inputs.free(held)
    assert _edit(app, image, mask).status_code == 200  # room again: served
    assert engine.inputs.used_bytes == 0  # and its inputs freed when it ended


def test_inputs_larger_than_the_whole_arena_are_a_400(small_inputs_app):
    app, _ = small_inputs_app
    response = _edit(app, _file(_picture(1, (256, 256))), size="256x256")
    assert "max_pending_input_bytes" in _error(response, 400, "image")["message"]


# -- the mask converter --------------------------------------------------------------------
def test_alpha_zero_becomes_white_and_the_rest_black():
    alpha = np.full((4, 6), 255, dtype=np.uint8)
    alpha[1:3, 2:5] = 0
    alpha[0, 0] = 1  # nearly transparent is not transparent (OpenAI: "fully transparent")
    rgba = np.dstack([np.full((4, 6, 3), 200, dtype=np.uint8), alpha])
    mask = mask_for_engine(Image.fromarray(rgba))
    assert mask.mode == "L"
    np.testing.assert_array_equal(np.asarray(mask), np.where(alpha == 0, 255, 0))
    la = mask_for_engine(Image.fromarray(np.dstack([np.zeros((4, 6), np.uint8), alpha])))
    np.testing.assert_array_equal(np.asarray(la), np.where(alpha == 0, 255, 0))
    # a palette image whose transparent colour is index 1
    palette = Image.fromarray(np.where(alpha == 0, 1, 0).astype(np.uint8), mode="P")
    palette.putpalette([0, 0, 0, 255, 255, 255])
    palette.info["transparency"] = 1
    reread = Image.open(io.BytesIO(_file(palette)))
    np.testing.assert_array_equal(np.asarray(mask_for_engine(reread)),
                                  np.where(alpha == 0, 255, 0))


def test_a_mask_without_alpha_is_kept_as_is():
    gray = Image.fromarray(np.arange(24, dtype=np.uint8).reshape(4, 6) * 10)
    assert mask_for_engine(gray) is gray
    rgb = gray.convert("RGB")
    assert mask_for_engine(rgb) is rgb
    with pytest.raises(InvalidRequestError, match="no fully transparent pixel") as info:
        mask_for_engine(Image.new("RGBA", (4, 4), (0, 0, 0, 255)), "mask")
    assert info.value.field == "mask"


def test_the_openapi_schema_describes_both_forms(flux_app):
    doc = json.loads(call(flux_app, "GET", "/openapi.json").text)
    content = doc["paths"][EDITS]["post"]["requestBody"]["content"]
    assert set(content) == {"multipart/form-data", "application/json"}
    assert content["multipart/form-data"]["schema"]["properties"]["image"]["format"] == "binary"
    assert "strength" in content["application/json"]["schema"]["properties"]
    generations = doc["paths"]["/v1/images/generations"]["post"]["requestBody"]
    ref = generations["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    assert "strength" not in doc["components"]["schemas"][ref]["properties"]


@pytest.mark.parametrize("model", ["tiny-flux-kontext", "tiny-qwen-image-edit-plus"])
def test_an_editing_model_edits_over_http_as_the_engine_does(model):
    """An editing model sizes its inputs its own way (Kontext keeps the
    input's size; Qwen-Image-Edit Plus also reads a copy of its own size
    with the prompt): over HTTP the pixels are those of the same picture
    given to the engine directly, and a mask (not served with an edit yet)
    is refused by the engine's own check, named as the body names it."""
    from diffrt.engine import DiffusionRequest, SamplingParams

    picture = _picture(8, (96, 80))
    with DiffusionEngine.make_engine(EngineConfig(
            model=model, executor_backend="inproc", step_execution=True, max_num_seqs=1,
            warmup=False)) as engine:
        app = build_app(settings=ServeSettings(api_key=API_KEY), engine=engine)
        response = call(app, "POST", EDITS, files=[("image", ("a.png", _file(picture),
                                                              "image/png"))],
                        data={"prompt": "make it blue", "num_inference_steps": "2",
                              "seed": "5"})
        assert response.status_code == 200, response.text[:300]
        direct = engine.generate(DiffusionRequest(
            "make it blue", images=[picture],
            sampling_params=SamplingParams(seed=5, num_inference_steps=2)))
        assert direct.ok, direct.error
        engine_pixels = np.asarray(direct.images[0].convert("RGB"), dtype=np.int16)
        assert np.abs(_pixels(response.json()) - engine_pixels).max() <= 1
        masked = _edit(app, _file(picture), _file(_square_mask((96, 80))), size="auto",
                       num_inference_steps="2")
        error = _error(masked, 400, "mask")
        assert error["message"].startswith(f"mask: {model} edits without a mask"), error


def test_a_json_edit_body_that_is_not_text_is_a_400_not_a_500(flux_app):
    """Bytes that are no UTF-8 (schemathesis found b'\\x80') are a client's error."""
    for route in (EDITS, "/v1/images/generations"):
        answer = call(flux_app, "POST", route, content=b"\x80",
                      headers={**AUTH, "content-type": "application/json"})
        assert answer.status_code in (400, 422), (route, answer.text)
