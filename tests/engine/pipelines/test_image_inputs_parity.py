"""Image-to-image and inpainting give diffusers' pixels (≤ 2/255, float32) for
Flux, SD3 and Qwen-Image: whole requests alone and fused, and step by step in
one batch with a text-to-image request of another size (each keeps its own
start step and step count).

Where diffrt differs from diffusers on purpose, the reference is adjusted the
same way, in the open: inpainting keeps the input's own pixels outside the
mask (diffusers' ``apply_overlay``; its VAE round trip otherwise drifts the
whole picture), so the reference is diffusers' image composited by the
binarised mask. diffusers' StableDiffusion3InpaintPipeline decodes without
the VAE's ``shift_factor`` (its text-to-image and img2img pipelines add it;
diffrt adds it always), so the SD3 folder here has a shift of 0; and it runs
only a 16-channel transformer, so this folder has 16 latent channels.
"""

from __future__ import annotations

import contextlib
import json

import numpy as np
import PIL.Image
import pytest
import torch

from diffrt.engine.models.embedded import embedded_folder
from diffrt.engine.models.tiny.sd3 import build_tiny_sd3_folder
from diffrt.engine.pipelines import DiffusionRequestBatch, load_pipeline
from diffrt.engine.pipelines.interface import StepRequestState
from diffrt.engine.postprocess import quantize_images
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import SamplingParams

SIZE, STEPS = 64, 4
MAX_DIFF = 2  # of 255
PROMPT = "a red fox in the snow"
#: family -> its diffusers classes (text-to-image, img2img, inpaint) and guidance
FAMILIES = {
    "flux": (("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline"),
             {"guidance_scale": 3.5}),
    "sd3": (("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline",
             "StableDiffusion3InpaintPipeline"), {"guidance_scale": 2.0}),
    "qwen-image": (("QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline"),
                   {"true_cfg_scale": 4.0, "negative_prompt": "blurry"}),
}


def _input_image() -> PIL.Image.Image:
    """Not the output size, so the resize is diffusers' too."""
    return PIL.Image.fromarray(np.random.default_rng(7).integers(0, 255, (80, 72, 3),
                                                                 dtype=np.uint8))


def _mask() -> PIL.Image.Image:
    mask = np.zeros((80, 72), np.uint8)
    mask[36:, 28:] = 255
    return PIL.Image.fromarray(mask)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, qwen_folder) -> dict[str, str]:
    sd3 = build_tiny_sd3_folder(tmp_path_factory.mktemp("sd3") / "sd3", seed=0, latent_channels=16)
    config_path = sd3 / "vae" / "config.json"
    config = json.loads(config_path.read_text())
    config["shift_factor"] = 0.0
    config_path.write_text(json.dumps(config))
    return {"flux": embedded_folder("tiny-flux"), "sd3": str(sd3), "qwen-image": qwen_folder}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, folders):
    """(ours, diffusers' pipelines by task, the guidance fields) of one family."""
    import diffusers

    classes, guidance = FAMILIES[request.param]
    base = getattr(diffusers, classes[0]).from_pretrained(folders[request.param],
                                                         local_files_only=True)
    theirs = {"text-to-image": base,
              "image-to-image": getattr(diffusers, classes[1]).from_pipe(base),
              "inpainting": getattr(diffusers, classes[2]).from_pipe(base)}
    for pipe in theirs.values():
        pipe.set_progress_bar_config(disable=True)
    return load_pipeline(folders[request.param]), theirs, guidance


def _request(task: str, seed: int, guidance: dict, *, strength: float | None = None,
             size: tuple[int, int] = (SIZE, SIZE)) -> DiffusionRequest:
    fields = {k: v for k, v in guidance.items() if k != "negative_prompt"}
    images = [_input_image()] if task != "text-to-image" else []
    return DiffusionRequest(
        PROMPT, request_id=f"{task}-{seed}", negative_prompt=guidance.get("negative_prompt"),
        images=images, mask_image=_mask() if task == "inpainting" else None,
        sampling_params=SamplingParams(height=size[0], width=size[1], num_inference_steps=STEPS,
                                       seed=seed, strength=strength, **fields))


def _reference(theirs: dict, request: DiffusionRequest) -> np.ndarray:
    params = request.sampling_params
    kwargs = {k: getattr(params, k) for k in ("guidance_scale", "true_cfg_scale")
              if getattr(params, k) is not None}
    if request.negative_prompt is not None:
        kwargs["negative_prompt"] = request.negative_prompt
    if request.images:
        kwargs.update(image=request.images[0], strength=params.strength)
    if request.mask_image is not None:
        kwargs["mask_image"] = request.mask_image
    image = theirs[request.task](
        request.prompt, height=params.height, width=params.width,
        num_inference_steps=STEPS, generator=torch.Generator("cpu").manual_seed(params.seed),
        output_type="np", **kwargs).images[0]
    image = (image * 255).round().astype(np.int16)
    if request.mask_image is not None:  # the input's pixels outside the mask (module docstring)
        size = (params.width, params.height)
        kept = np.asarray(request.images[0].convert("RGB").resize(size, PIL.Image.LANCZOS))
        inside = np.asarray(request.mask_image.convert("L").resize(size, PIL.Image.LANCZOS)) >= 128
        image = np.where(inside[..., None], image, kept.astype(np.int16))
    return image


def _pixels(image: torch.Tensor) -> np.ndarray:
    return quantize_images(image)[0].numpy().astype(np.int16)


def _stepped(pipe, requests: list[DiffusionRequest]) -> list[torch.Tensor]:
    """The step protocol over ``requests`` in one batch, each leaving it when done."""
    states = [StepRequestState(request=r) for r in requests]
    pipe.prepare_encode_batch(states)
    out: dict[str, torch.Tensor] = {}
    live = list(states)
    while live:
        parts = pipe.split_predictions(pipe.denoise_step(live), live)
        for state, part in zip(live, parts, strict=True):
            pipe.apply_step(state, part)
        done = [s for s in live if s.finished]
        if done:
            out.update(zip((s.request_id for s in done), pipe.post_decode_batch(done),
                           strict=True))
        live = [s for s in live if not s.finished]
    return [out[r.request_id] for r in requests]


def test_image_to_image_and_inpainting_match_diffusers_alone_fused_and_stepped(family):
    ours, theirs, guidance = family
    i2i = [_request("image-to-image", seed, guidance, strength=0.5) for seed in (1, 2)]
    inpaint = _request("inpainting", 3, guidance, strength=0.75)
    t2i = _request("text-to-image", 4, guidance, size=(SIZE, SIZE + 32))
    want = {r.request_id: _reference(theirs, r) for r in [*i2i, inpaint, t2i]}
    assert i2i[0].sampling_params.denoise_steps() == 2  # as diffusers rounds 4 x 0.5
    assert inpaint.sampling_params.denoise_steps() == 3

    alone = {r.request_id: ours.forward(DiffusionRequestBatch([r]))[0] for r in [*i2i, inpaint]}
    fused = dict(zip((r.request_id for r in i2i), ours.forward(DiffusionRequestBatch(i2i)),
                     strict=True))
    mixed = [i2i[0], inpaint, t2i]
    stepped = dict(zip((r.request_id for r in mixed), _stepped(ours, mixed), strict=True))
    for results in (alone, fused, stepped):
        for rid, image in results.items():
            diff = np.abs(_pixels(image) - want[rid]).max()
            assert diff <= MAX_DIFF, f"{rid}: {diff}/255 from diffusers"
    # the input image shows through at strength 0.5; without one the picture differs
    assert np.abs(want[i2i[0].request_id] - want[t2i.request_id][:, :SIZE]).mean() > 5


@pytest.fixture(scope="module")
def kontext():
    import diffusers

    theirs = diffusers.FluxKontextPipeline.from_pretrained(embedded_folder("tiny-flux-kontext"),
                                                          local_files_only=True)
    theirs.set_progress_bar_config(disable=True)
    return load_pipeline("tiny-flux-kontext"), theirs


def _edit(rid: str, image, size: tuple[int, int], seed: int) -> DiffusionRequest:
    return DiffusionRequest(PROMPT, request_id=rid, images=[image] if image else [],
                            sampling_params=SamplingParams(height=size[0], width=size[1],
                                                           num_inference_steps=STEPS, seed=seed,
                                                           guidance_scale=3.5))


def test_kontext_edits_match_diffusers_alone_fused_and_stepped_with_text_to_image(kontext):
    """FLUX.1 Kontext: the input image's tokens follow the noise's; inputs of
    other sizes are rows of other lengths, so edits share steps with each
    other and with text-to-image (the tiny model keeps its input's size, as
    FluxKontextPipeline with ``_auto_resize=False``; diffusers is given
    ``max_area`` = the requested area, which diffrt always honours)."""
    ours, theirs = kontext
    wide = PIL.Image.fromarray(np.random.default_rng(1).integers(0, 255, (48, 80, 3), np.uint8))
    requests = [_edit("edit-a", _input_image(), (SIZE, SIZE), 1),
                _edit("edit-b", wide, (SIZE, SIZE + 32), 2),
                _edit("edit-c", _input_image(), (SIZE, SIZE), 5),
                _edit("draw", None, (SIZE, SIZE), 3)]
    assert ours.spec.row_tokens(requests[1]) - ours.spec.row_tokens(requests[3]) > 0
    want = {}
    for r in requests:
        params = r.sampling_params
        kwargs = {"image": r.images[0], "_auto_resize": False} if r.images else {}
        image = theirs(prompt=r.prompt, height=params.height, width=params.width,
                       max_area=params.height * params.width, num_inference_steps=STEPS,
                       guidance_scale=3.5, generator=torch.Generator("cpu").manual_seed(params.seed),
                       output_type="np", **kwargs).images[0]
        want[r.request_id] = (image * 255).round().astype(np.int16)
    alone = {r.request_id: ours.forward(DiffusionRequestBatch([r]))[0] for r in requests[:2]}
    fused = dict(zip(("edit-a", "edit-c"), ours.forward(DiffusionRequestBatch(
        [requests[0], requests[2]])), strict=True))
    stepped = dict(zip((r.request_id for r in requests), _stepped(ours, requests), strict=True))
    for results in (alone, fused, stepped):
        for rid, image in results.items():
            diff = np.abs(_pixels(image) - want[rid]).max()
            assert diff <= MAX_DIFF, f"{rid}: {diff}/255 from diffusers"
    assert np.abs(want["edit-a"] - want["draw"]).mean() > 3  # the input image shows


def test_kontext_sizes_its_input_as_diffusers_does():
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    from diffrt.engine.pipelines.flux.spec import KONTEXT_RESOLUTIONS

    assert list(KONTEXT_RESOLUTIONS) == PREFERRED_KONTEXT_RESOLUTIONS
    from diffrt.engine.models.registry import resolve_model_spec

    spec = resolve_model_spec("tiny-flux-kontext")
    request = _edit("r", _input_image(), (SIZE, SIZE), 0)
    m = spec.size_multiple
    assert spec.input_size(request, 72, 80) == (80 // m * m, 72 // m * m)  # kept, rounded down
    import msgspec

    preferred = msgspec.structs.replace(spec, edit_resize="preferred")
    assert preferred.input_size(request, 1000, 500) == (720, 1456)  # the nearest to 2:1



@contextlib.contextmanager
def _first_transformer_input(transformer):
    """The keyword arguments of ``transformer``'s first call inside the block."""
    seen: dict = {}

    def hook(module, args, kwargs):
        if not seen:
            seen.update({k: v.clone() if isinstance(v, torch.Tensor) else v
                         for k, v in kwargs.items()})

    handle = transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


@pytest.fixture(scope="module")
def qwen_edit():
    """Ours and diffusers' QwenImageEditPipeline on the tiny edit folder,
    diffusers' fixed 1024 x 1024 input area shrunk to the tiny model's 64 x 64
    (its ``calculate_dimensions``; diffrt's is the spec's ``edit_area``)."""
    import diffusers
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

    from diffrt.engine.models.vl_processor import load_vl_processor

    folder = embedded_folder("tiny-qwen-image-edit")
    theirs = diffusers.QwenImageEditPipeline.from_pretrained(
        folder, local_files_only=True, processor=load_vl_processor(f"{folder}/processor"))
    theirs.set_progress_bar_config(disable=True)
    original = pipeline_qwenimage_edit.calculate_dimensions
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline_qwenimage_edit, "calculate_dimensions",
                      lambda area, ratio: original(SIZE * SIZE, ratio))
        yield load_pipeline("tiny-qwen-image-edit"), theirs


def test_qwen_image_edit_matches_diffusers_alone_and_stepped(qwen_edit):
    """Qwen2.5-VL reads each edit's image with its prompt (so the prompt
    cache is passed by), the image's latents join the sequence as a second
    frame; edits of other input shapes share steps (rows of other lengths)."""
    ours, theirs = qwen_edit
    wide = PIL.Image.fromarray(np.random.default_rng(1).integers(0, 255, (48, 80, 3), np.uint8))

    def edit(rid: str, image, seed: int) -> DiffusionRequest:
        return DiffusionRequest("make it blue", request_id=rid, images=[image],
                                negative_prompt="blurry", sampling_params=SamplingParams(
                                    num_inference_steps=STEPS, seed=seed, true_cfg_scale=4.0))

    requests = [edit("square", _input_image(), 1), edit("wide", wide, 2),
                edit("square-2", _input_image().transpose(PIL.Image.FLIP_LEFT_RIGHT), 1)]
    want = {}
    with _first_transformer_input(theirs.transformer) as theirs_input:
        for r in requests:
            image = theirs(image=r.images[0], prompt=r.prompt, negative_prompt=r.negative_prompt,
                           true_cfg_scale=4.0, num_inference_steps=STEPS, output_type="np",
                           generator=torch.Generator("cpu").manual_seed(r.sampling_params.seed)
                           ).images[0]
            want[r.request_id] = (image * 255).round().astype(np.int16)
    assert want["wide"].shape[:2] == (64, 96)  # the input's aspect at the edit area
    with _first_transformer_input(ours.transformer) as ours_input:
        alone = {r.request_id: ours.forward(DiffusionRequestBatch([r]))[0] for r in requests[:1]}
    # the tiny VAE's latents barely move the picture, so the image tokens the
    # transformer is given are compared directly: the noise, then the input's
    # latents, and their frames
    assert ours_input["img_shapes"][0] == theirs_input["img_shapes"][0]
    torch.testing.assert_close(ours_input["hidden_states"][0], theirs_input["hidden_states"][0],
                               rtol=0, atol=1e-5)
    stepped = dict(zip((r.request_id for r in requests), _stepped(ours, requests), strict=True))
    for results in (alone, stepped):
        for rid, image in results.items():
            diff = np.abs(_pixels(image) - want[rid]).max()
            assert diff <= MAX_DIFF, f"{rid}: {diff}/255 from diffusers"
    # same prompt and seed, another image: another picture (the text encoder saw it)
    assert np.abs(want["square"] - want["square-2"]).mean() > 1


def test_qwen_image_edit_plus_reads_several_images_as_diffusers_does(monkeypatch):
    """Plus: each input's latents are one more frame, and Qwen2.5-VL reads
    each at its own (smaller) area with "Picture N:" before the prompt; the
    default size follows the last image. diffusers' fixed input areas are
    shrunk to the tiny model's, and its output (1 Mpx by default whatever
    the areas) is given the size diffrt defaults to."""
    import diffusers
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

    from diffrt.engine.models.vl_processor import load_vl_processor

    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", SIZE * SIZE)
    # the spec's prompt area: smaller than the VAE's, so a swapped copy shows
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "CONDITION_IMAGE_SIZE", 40 * 40)
    folder = embedded_folder("tiny-qwen-image-edit-plus")
    theirs = diffusers.QwenImageEditPlusPipeline.from_pretrained(
        folder, local_files_only=True, processor=load_vl_processor(f"{folder}/processor"))
    theirs.set_progress_bar_config(disable=True)
    ours = load_pipeline("tiny-qwen-image-edit-plus")
    wide = PIL.Image.fromarray(np.random.default_rng(1).integers(0, 255, (48, 80, 3), np.uint8))
    requests = [DiffusionRequest("put them side by side", request_id=rid, images=images,
                                 negative_prompt="blurry", sampling_params=SamplingParams(
                                     num_inference_steps=STEPS, seed=seed, true_cfg_scale=4.0))
                for rid, images, seed in [("two", [wide, _input_image()], 1),
                                          ("one", [wide], 2)]]
    want, theirs_input = {}, {}
    for r in requests:
        params = ours.prepared(r).sampling_params
        with _first_transformer_input(theirs.transformer) as theirs_input[r.request_id]:
            image = theirs(image=r.images, prompt=r.prompt, negative_prompt=r.negative_prompt,
                           height=params.height, width=params.width, true_cfg_scale=4.0,
                           num_inference_steps=STEPS, output_type="np",
                           generator=torch.Generator("cpu").manual_seed(params.seed)).images[0]
        want[r.request_id] = (image * 255).round().astype(np.int16)
    assert want["two"].shape[:2] == (64, 64) and want["one"].shape[:2] == (64, 96)  # the last's
    # each input's latents at the VAE's area (the VL's smaller copy elsewhere),
    # in its own frame: the transformer's first input, compared directly
    with _first_transformer_input(ours.transformer) as ours_input:
        ours.forward(DiffusionRequestBatch([requests[0]]))
    assert ours_input["img_shapes"][0] == theirs_input["two"]["img_shapes"][0]
    torch.testing.assert_close(ours_input["hidden_states"][0],
                               theirs_input["two"]["hidden_states"][0], rtol=0, atol=1e-5)
    stepped = dict(zip((r.request_id for r in requests), _stepped(ours, requests), strict=True))
    for rid, image in stepped.items():
        diff = np.abs(_pixels(image) - want[rid]).max()
        assert diff <= MAX_DIFF, f"{rid}: {diff}/255 from diffusers"
