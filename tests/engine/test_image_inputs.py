"""Input images through the engine: what is refused at submission (naming the
field), how inputs are converted, that their bytes are freed in every ending,
that image-to-image shares denoise steps with text-to-image (step mode) and
fuses with its equals (request mode). Pixel parity with diffusers is
``pipelines/test_image_inputs_parity.py``'s."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import PIL.Image
import pytest
from engine_helpers import assert_clean, toy_request, wait_until

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams
from diffrt.engine.errors import InputsFullError
from diffrt.engine.input_images import StoredImage, to_arrays
from diffrt.engine.models.registry import resolve_model_spec
from diffrt.engine.sampling import InvalidRequestError
from diffrt.engine.submission import accept
from diffrt.runtime.input_arena import InputArena, InputArenaFullError, InputHandle

SIZE = 64
RNG = np.random.default_rng(0)
PICTURE = PIL.Image.fromarray(RNG.integers(0, 255, (SIZE, SIZE, 3), dtype=np.uint8))
MASK = PIL.Image.fromarray(np.where(np.arange(SIZE)[None, :] < SIZE // 2, 0, 255)
                           .repeat(SIZE, 0).astype(np.uint8))


def image_request(rid: str, *, strength: float | None = 0.5, steps: int = 4, mask=None,
                  images=None, seed: int = 1, **fields) -> DiffusionRequest:
    return DiffusionRequest(
        "a red circle", request_id=rid, images=[PICTURE] if images is None else images,
        mask_image=mask, sampling_params=SamplingParams(
            height=SIZE, width=SIZE, num_inference_steps=steps, seed=seed, strength=strength,
            **fields))


@pytest.fixture(scope="module")
def flux_spec():
    return resolve_model_spec("tiny-flux")


def _accept(request, spec, inputs=None):
    return accept(request, spec, EngineConfig(model=spec.name), None,
                  inputs or InputArena(1 << 20))


@pytest.mark.parametrize("build,field", [
    (lambda: DiffusionRequest("p", sampling_params=SamplingParams(strength=0.5)), "strength"),
    (lambda: DiffusionRequest("p", mask_image=MASK), "mask_image"),
    (lambda: image_request("r", strength=0.0), "strength"),
    (lambda: image_request("r", strength=1.5), "strength"),
    (lambda: image_request("r", images=[PICTURE, PICTURE]), "images"),
    (lambda: image_request("r", strength=1e-17, steps=10), "strength"),  # no step left
    (lambda: image_request("r", images=["picture.png"]), "images[0]"),
    (lambda: image_request("r", images=[StoredImage(InputHandle(0, (64, 64, 3), 1))]),
     "images[0]"),
    (lambda: image_request("r", images=[np.zeros((8, 8, 2), np.uint8)]), "images[0]"),
    (lambda: image_request("r", images=[np.full((8, 8), 2.0)]), "images[0]"),
    (lambda: image_request("r", images=[PIL.Image.new("I", (8, 8))]), "images[0]"),
    (lambda: image_request("r", mask=MASK.resize((32, 32))), "mask_image"),
    (lambda: image_request("r", mask="mask.png"), "mask_image"),
    (lambda: image_request("r", images=[PIL.Image.new("RGB", (5000, 4000))]), "images[0]"),
])
def test_what_is_refused_names_the_field(flux_spec, build, field):
    with pytest.raises(InvalidRequestError) as info:
        _accept(build(), flux_spec)
    assert info.value.field == field


def test_a_model_that_serves_no_image_task_refuses_naming_task_and_model():
    spec = resolve_model_spec("toy")
    with pytest.raises(InvalidRequestError, match="image-to-image is not a task of toy") as info:
        _accept(image_request("r"), spec)
    assert info.value.field == "images"
    with pytest.raises(InvalidRequestError, match="inpainting is not a task of toy") as info:
        _accept(image_request("r", mask=MASK), spec)
    assert info.value.field == "mask_image"


def test_accepted_requests_carry_handles_the_defaults_and_the_steps_that_run(flux_spec):
    arena = InputArena(1 << 20)
    accepted = _accept(image_request("r", strength=None, steps=10, mask=MASK), flux_spec, arena)
    assert accepted.sampling_params.strength == 0.6  # the model's (diffusers') default
    assert accepted.sampling_params.denoise_steps() == 6  # 10 - int(10 - 6)
    assert arena.used_bytes == SIZE * SIZE * 3 + SIZE * SIZE  # the image and the mask
    import msgspec

    wire = msgspec.msgpack.encode(accepted)
    assert len(wire) < 2000  # handles, not pixels


def _png(image: PIL.Image.Image, **save) -> PIL.Image.Image:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG" if image.mode != "CMYK" else "JPEG", **save)
    return PIL.Image.open(io.BytesIO(buffer.getvalue()))


def test_inputs_convert_as_diffusers_loads_images():
    rgb = np.asarray(PICTURE)
    rgba = PIL.Image.fromarray(np.dstack([rgb, np.full(rgb.shape[:2], 7, np.uint8)]))
    grey16 = PIL.Image.fromarray(rgb[..., 0].astype(np.uint16) * 257)
    assert grey16.mode.startswith("I;16")
    frames = [PICTURE, PIL.Image.new("RGB", PICTURE.size, (0, 255, 0))]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    animated = PIL.Image.open(io.BytesIO(buffer.getvalue()))
    assert animated.n_frames == 2
    cases = {
        "rgba drops alpha": (rgba, PICTURE),
        "16-bit grey scaled to 8": (grey16, PIL.Image.fromarray(rgb[..., 0]).convert("RGB")),
        "palette": (PICTURE.quantize(16), PICTURE.quantize(16).convert("RGB")),
        "cmyk": (_png(PICTURE.convert("CMYK")), _png(PICTURE.convert("CMYK")).convert("RGB")),
        "animated: the first frame": (animated, animated.convert("RGB")),
        "uint8 array": (rgb, PICTURE),
        "float array in [0, 1]": (rgb / 255.0, PICTURE),
    }
    for name, (given, expected) in cases.items():
        arrays = to_arrays([given], None, lambda w, h: (48, 32)).images
        want = np.asarray(expected.convert("RGB").resize((32, 48), PIL.Image.LANCZOS))
        assert arrays[0].shape == (48, 32, 3), name
        assert np.array_equal(arrays[0], want), name
    mask = to_arrays([PICTURE], MASK.convert("RGB"), lambda w, h: (48, 32)).mask
    assert mask is not None and mask.shape == (48, 32)
    assert np.array_equal(mask, np.asarray(MASK.resize((32, 48), PIL.Image.LANCZOS)))


def test_a_full_input_arena_refuses_until_inputs_are_freed(flux_spec):
    arena = InputArena(SIZE * SIZE * 3 + 4096)
    first = _accept(image_request("a"), flux_spec, arena)
    with pytest.raises(InputsFullError, match="max_pending_input_bytes"):
        _accept(image_request("b"), flux_spec, arena)
    from diffrt.engine.input_images import release

    release(first, arena)
    assert arena.used_bytes == 0
    _accept(image_request("b"), flux_spec, arena)
    with pytest.raises(InvalidRequestError, match="max_pending_input_bytes") as info:
        _accept(image_request("c"), flux_spec, InputArena(8192))  # larger than the whole arena
    assert info.value.field == "images"


# -- through the engine -------------------------------------------------------------------
def _denoise_batches(engine: DiffusionEngine, monkeypatch) -> list[list[str]]:
    """The request ids of every denoise call the in-process worker makes."""
    pipeline = engine.executor.core.runner.pipeline  # type: ignore[attr-defined]
    calls: list[list[str]] = []
    original = pipeline.denoise_step

    def spy(states):
        calls.append([s.request_id for s in states])
        return original(states)

    monkeypatch.setattr(pipeline, "denoise_step", spy)
    return calls


def test_step_mode_image_to_image_shares_steps_with_text_to_image(flux_step_engine, monkeypatch):
    engine = flux_step_engine
    calls = _denoise_batches(engine, monkeypatch)
    i2i = image_request("img-share", strength=0.5, steps=8)
    inpaint = image_request("inp-share", strength=0.75, steps=8, mask=MASK)
    t2i = DiffusionRequest("a blue square", request_id="t2i-share", sampling_params=SamplingParams(
        height=SIZE, width=SIZE + 32, num_inference_steps=8, seed=2))
    outs = engine.generate([i2i, inpaint, t2i], timeout=120)
    assert [o.error for o in outs] == [None, None, None]
    assert [o.total_steps for o in outs] == [4, 6, 8]  # the steps that ran
    assert any({"img-share", "inp-share", "t2i-share"} <= set(c) for c in calls), calls
    assert engine.inputs is not None and engine.inputs.used_bytes == 0
    assert_clean(engine)
    # outside the mask the input's pixels, inside a new picture
    image = np.asarray(outs[1].images[0]).astype(int)
    kept = np.asarray(PICTURE).astype(int)
    assert np.array_equal(image[:, :SIZE // 2], kept[:, :SIZE // 2])
    assert np.abs(image[:, SIZE // 2:] - kept[:, SIZE // 2:]).mean() > 10


def test_a_preview_of_image_to_image_comes_from_its_own_schedule(flux_step_engine):
    async def main():
        request = image_request("img-preview", strength=0.5, steps=8, partial_images=1)
        return [o async for o in flux_step_engine.step_streaming(request)]

    outs = asyncio.run(main())
    previews = [o for o in outs if o.preview is not None]
    assert len(previews) == 1 and previews[0].step == 2  # after step 2 of the 4 that run
    assert outs[-1].finished and outs[-1].error is None and outs[-1].total_steps == 4


def test_inputs_are_freed_on_abort_error_and_timeout(flux_step_engine, monkeypatch):
    engine = flux_step_engine
    inputs = engine.inputs
    assert inputs is not None
    # timeout: its own limit ends it while it runs
    out = engine.generate(image_request("img-timeout", steps=50, strength=1.0, timeout_s=0.3),
                          timeout=60)
    assert out.timed_out
    # abort: the user ends it right after submitting
    async def submit_and_abort():
        request = image_request("img-abort", steps=50, strength=1.0)
        stream = flux_step_engine.step_streaming(request)
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.2)
        flux_step_engine.abort("img-abort")
        try:
            await task
        except StopAsyncIteration:
            pass
    asyncio.run(submit_and_abort())
    # error: preparing it fails in the worker
    pipeline = engine.executor.core.runner.pipeline  # type: ignore[attr-defined]

    def broken(states):
        raise RuntimeError("VAE exploded")

    monkeypatch.setattr(pipeline, "prepare_encode_batch", broken)
    out = engine.generate(image_request("img-error"), timeout=60)
    assert out.error is not None and "VAE exploded" in out.error
    assert wait_until(lambda: inputs.used_bytes == 0)
    assert_clean(engine)


@pytest.fixture(scope="module")
def request_engine():
    with DiffusionEngine.make_engine(EngineConfig(model="tiny-flux", executor_backend="inproc",
                                                  max_num_seqs=4)) as engine:
        yield engine


def test_request_mode_fuses_equal_tasks_only(request_engine, monkeypatch):
    pipeline = request_engine.executor.core.runner.pipeline  # type: ignore[attr-defined]
    batches: list[list[str]] = []
    original = pipeline.forward

    def spy(batch):
        batches.append([r.request_id for r in batch.requests])
        return original(batch)

    monkeypatch.setattr(pipeline, "forward", spy)
    requests = [image_request("rq-a", seed=2), image_request("rq-b"),
                image_request("rq-m", mask=MASK),
                DiffusionRequest("a blue square", request_id="rq-t", sampling_params=SamplingParams(
                    height=SIZE, width=SIZE, num_inference_steps=4, seed=1))]
    outs = request_engine.generate(requests, timeout=120)
    assert [o.error for o in outs] == [None] * 4
    assert sorted(map(sorted, batches)) == [["rq-a", "rq-b"], ["rq-m"], ["rq-t"]]
    assert request_engine.inputs is not None and request_engine.inputs.used_bytes == 0
    # alone or fused, the same pixels (up to the batched matmuls' rounding)
    alone = request_engine.generate(image_request("rq-b2"), timeout=60)
    diff = np.abs(np.asarray(alone.images[0]).astype(int) - np.asarray(outs[1].images[0])).max()
    assert diff <= 1


def test_toy_engines_refuse_images_naming_the_task(req_engine1):
    request = toy_request("p")
    request.images = [PICTURE]
    with pytest.raises(InvalidRequestError, match="image-to-image is not a task"):
        req_engine1.generate(request, timeout=10)


def test_an_edit_only_model_warms_up_on_an_edit_and_refuses_text_alone():
    """Qwen-Image-Edit draws nothing from text alone: the engine's start-up
    requests carry a plain picture; an edit's default size is its input's
    aspect at the model's edit area. A restart's warm-up picture stays stored
    from the start, so fresh workers warm up even when queued requests' inputs
    fill the arena."""
    wide = PIL.Image.fromarray(RNG.integers(0, 255, (48, 80, 3), dtype=np.uint8))
    with DiffusionEngine.make_engine(EngineConfig(
            model="tiny-qwen-image-edit", executor_backend="inproc", step_execution=True,
            restart_workers=True, max_pending_input_bytes=1 << 20)) as engine:
        inputs = engine.inputs
        assert inputs is not None
        kept = inputs.used_bytes  # the restart warm-up's picture
        assert 0 < kept < 1 << 16
        out = engine.generate(DiffusionRequest("make it blue", images=[wide],
                                               sampling_params=SamplingParams(seed=1)), timeout=120)
        assert out.ok and out.images[0].size == (96, 64)  # the input's aspect, its area
        with pytest.raises(InvalidRequestError, match="text-to-image is not a task"):
            engine.generate(DiffusionRequest("a cat"), timeout=10)
        assert inputs.used_bytes == kept
        filler = []  # what queued requests would hold: every byte
        for piece in (1 << 16, 1):
            with pytest.raises(InputArenaFullError):
                for _ in range((1 << 20) // piece):
                    filler.append(inputs.put(np.zeros(piece, np.uint8)))
        with pytest.raises(InputArenaFullError):
            inputs.put(np.zeros(kept, np.uint8))  # no room for another warm-up picture
        engine._fresh_executor().shutdown()  # what a restart runs: it warms up
        for handle in filler:
            inputs.free(handle)
        assert inputs.used_bytes == kept
    assert inputs.used_bytes == 0


def test_kontext_edits_cost_their_tokens_and_refuse_strength_and_masks():
    spec = resolve_model_spec("tiny-flux-kontext")
    wide = PIL.Image.fromarray(RNG.integers(0, 255, (48, 80, 3), dtype=np.uint8))
    edit = DiffusionRequest("make it blue", images=[wide],
                            sampling_params=SamplingParams(height=SIZE, width=SIZE, seed=1))
    draw = DiffusionRequest("a cat", sampling_params=SamplingParams(height=SIZE, width=SIZE))
    extra = spec.row_tokens(spec.with_defaults(edit)) - spec.row_tokens(spec.with_defaults(draw))
    m = spec.size_multiple
    assert extra == (48 // m) * (80 // m)  # the input's patches, as it is kept
    stored = _accept(edit, spec)  # a stored input counts the same
    assert spec.row_tokens(stored) - spec.row_tokens(spec.with_defaults(draw)) == extra
    for request, field in [(image_request("s"), "strength"),
                           (image_request("m", strength=None, mask=MASK), "mask_image")]:
        with pytest.raises(InvalidRequestError) as info:
            _accept(request, spec)
        assert info.value.field == field


def test_a_submission_refused_after_its_inputs_were_stored_frees_them(flux_step_engine):
    engine = flux_step_engine
    assert engine.inputs is not None
    cases = [[image_request("dup"), image_request("dup")],  # an id given twice
             [image_request("ok"), image_request("bad", strength=2.0)],  # a later one refused
             [image_request("lora", loras={"nowhere": 1.0})]]  # an adapter not registered
    for requests in cases:
        with pytest.raises(InvalidRequestError):
            engine.generate(requests, timeout=10)
        assert engine.inputs.used_bytes == 0


def test_inputs_too_thin_for_the_model_are_refused_at_submission(flux_spec):
    thin = PIL.Image.new("RGB", (4096, 16))  # kept: 16 px high, 256:1
    with pytest.raises(InvalidRequestError, match="aspect ratio") as info:
        _accept(image_request("thin", images=[thin], strength=None),
                resolve_model_spec("tiny-flux-kontext"))
    assert info.value.field == "images[0]"
