"""The engine's pipelines on complete tiny diffusers folders give the pixels
diffusers' own pipelines give for the same folder, prompt and seed.

Covered: the folder's own text encoders (through diffusers' ``encode_prompt``),
SD3 with and without CFG, an SD3.5-style config, Flux without guidance and a
guidance-distilled Flux (embedded guidance), whole requests and step by step,
alone and batched, fp32 and bfloat16.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pipeline_steps import stepped

from diffrt.engine.models.tiny.flux import build_tiny_flux_folder
from diffrt.engine.models.tiny.sd3 import build_tiny_sd3_folder
from diffrt.engine.pipelines import DiffusionRequestBatch, load_pipeline
from diffrt.engine.pipelines.interface import StepRequestState
from diffrt.engine.postprocess import quantize_images
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import SamplingParams

PROMPTS = ["a red fox in the snow", "a blue circle"]
SIZE, STEPS = 64, 3
MAX_DIFF = 2  # of 255, fp32


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("folders")
    return {
        "flux": build_tiny_flux_folder(root / "flux", seed=0),
        "sd3": build_tiny_sd3_folder(root / "sd3", seed=0),
        "sd35": build_tiny_sd3_folder(root / "sd35", seed=0, sd35=True),
        "flux-distilled": build_tiny_flux_folder(root / "flux-distilled", seed=0,
                                                 guidance_embeds=True),
    }


@pytest.fixture(scope="module")
def loaded(folders):
    import diffusers

    out = {}
    for name, folder in folders.items():
        cls = diffusers.FluxPipeline if name.startswith("flux") else \
            diffusers.StableDiffusion3Pipeline
        out[name] = (cls.from_pretrained(folder, local_files_only=True),
                     load_pipeline(str(folder)))
    return out


def reference(pipe, prompt: str, seed: int, guidance: float, negative: str | None) -> np.ndarray:
    kw = {"negative_prompt": negative} if negative is not None else {}
    image = pipe(prompt, height=SIZE, width=SIZE, num_inference_steps=STEPS,
                 guidance_scale=guidance, generator=torch.Generator("cpu").manual_seed(seed),
                 output_type="np", **kw).images[0]
    return (image * 255).round().astype(np.int16)


def request(prompt: str, seed: int, guidance: float, negative: str | None) -> DiffusionRequest:
    return DiffusionRequest(prompt=prompt, negative_prompt=negative, request_id=f"{prompt}-{seed}",
                            sampling_params=SamplingParams(height=SIZE, width=SIZE,
                                                           num_inference_steps=STEPS, seed=seed,
                                                           guidance_scale=guidance))


def ours(image: torch.Tensor) -> np.ndarray:
    return quantize_images(image)[0].numpy().astype(np.int16)


CASES = [("flux", 1.0, None), ("flux-distilled", 3.5, None), ("sd3", 1.0, None), ("sd3", 2.0, None),
         ("sd3", 2.0, "a blurry picture"), ("sd35", 2.0, None)]


@pytest.mark.parametrize("family,guidance,negative", CASES)
def test_request_and_step_mode_alone_and_batched_match_diffusers(loaded, family, guidance,
                                                                 negative):
    theirs_pipe, our_pipe = loaded[family]
    requests = [request(p, seed, guidance, negative) for p in PROMPTS for seed in (0, 1)]
    expected = [reference(theirs_pipe, r.prompt, r.sampling_params.seed, guidance, negative)
                for r in requests]
    alone = [our_pipe.forward(DiffusionRequestBatch([r]))[0] for r in requests]
    batched = our_pipe.forward(DiffusionRequestBatch(requests))
    steps = stepped(our_pipe, requests)
    for want, *got in zip(expected, alone, batched, steps, strict=True):
        for image in got:
            assert np.abs(ours(image) - want).max() <= MAX_DIFF
    # the prompt matters: different prompts, different pictures
    assert np.abs(expected[0] - expected[2]).mean() > 2


def test_a_hub_id_in_the_local_cache_resolves_offline(folders, tmp_path, monkeypatch):
    import shutil

    from diffrt.engine.models.registry import UnknownModelError, resolve_model_spec

    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny--flux" / "snapshots" / "0123abcd"
    shutil.copytree(folders["flux"], snapshot)
    (cache / "models--tiny--flux" / "refs").mkdir()
    (cache / "models--tiny--flux" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))

    spec = resolve_model_spec("tiny/flux")
    assert spec.folder == str(snapshot.resolve())
    pipe = load_pipeline("tiny/flux")
    assert type(pipe.text_encoder).__name__ == "FolderTextEncoder"
    with pytest.raises(UnknownModelError, match=f"not in the local Hugging Face cache {cache}"):
        resolve_model_spec("tiny/missing")


def test_the_prompt_cache_returns_the_same_embeddings_and_stays_bounded(loaded):
    from diffrt.engine.pipelines.prompt_cache import CachedTextEncoder

    encoder = loaded["sd3"][1].text_encoder
    plain = encoder.encoder if isinstance(encoder, CachedTextEncoder) else encoder
    one_prompt = sum(t.numel() * t.element_size() for t in plain(["x"]))
    cache = CachedTextEncoder(plain, max_bytes=2 * one_prompt)
    embeds, pooled = cache(["a red fox", "", "a red fox"])
    want_e, want_p = plain(["a red fox", "", "a red fox"])
    # (encoded in a batch of another size: equal up to float reassociation)
    assert torch.allclose(embeds, want_e, atol=1e-5) and torch.allclose(pooled, want_p, atol=1e-5)
    assert (cache.misses, cache.hits) == (2, 1)  # one call for the two new prompts
    again = cache(["a red fox"])
    assert torch.equal(again[0], embeds[:1]) and cache.hits == 2  # the kept rows, as they were
    cache(["a blue circle"])  # a third prompt: the least recently used goes
    assert len(cache) == 2 and cache.bytes <= cache.max_bytes
    cache(["", "a red fox"])
    assert cache.misses == 4  # "" had been evicted, "a red fox" was still there


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family,guidance", [("flux", 1.0), ("sd3", 2.0)])
def test_half_precision_casts_as_diffusers_does(folders, family, guidance, dtype):
    """In half precision the order of casts matters (SD3 keeps its timesteps in
    float32, Flux casts them to the model dtype): the same pixels as diffusers
    in bfloat16 and float16, within 2/255 (CPU). diffusers is loaded as its
    users load it, ``from_pretrained(dtype=...)``, which keeps T5's ``wo``
    layers in float32 (``.to(dtype)`` would not, and differs by 3/255)."""
    import diffusers

    cls = diffusers.FluxPipeline if family == "flux" else diffusers.StableDiffusion3Pipeline
    theirs = cls.from_pretrained(folders[family], local_files_only=True, dtype=dtype)
    mine = load_pipeline(str(folders[family]), dtype=dtype)
    want = reference(theirs, PROMPTS[0], 0, guidance, None)
    got = ours(mine.forward(DiffusionRequestBatch([request(PROMPTS[0], 0, guidance, None)]))[0])
    assert np.abs(got - want).max() <= MAX_DIFF


def test_memory_options_keep_the_images(folders):
    """VAE slicing decodes one image at a time (same pixels); tiling decodes
    overlapping tiles and blends their seams (diffusers' tiled decode: an
    approximation meant for large images with tiles of hundreds of pixels; forced
    here with 32-pixel tiles only to see that it runs)."""
    plain = load_pipeline(str(folders["sd3"]))
    requests = [request(p, 0, 1.0, None) for p in PROMPTS]
    want = plain.forward(DiffusionRequestBatch(requests))

    sliced = load_pipeline(str(folders["sd3"]))
    sliced.configure_memory(vae_slicing=True)
    got = sliced.forward(DiffusionRequestBatch(requests))
    for a, b in zip(want, got, strict=True):
        assert np.abs(ours(a) - ours(b)).max() <= 1

    tiled = load_pipeline(str(folders["sd3"]))
    tiled.configure_memory(vae_tiling=True)
    tiled.vae.tile_sample_min_size, tiled.vae.tile_latent_min_size = 32, 4
    got = tiled.forward(DiffusionRequestBatch(requests[:1]))[0]
    assert got.shape == want[0].shape and torch.isfinite(got).all()
    assert np.abs(ours(want[0]) - ours(got)).max() > 0  # the tiled decode really ran


def test_requests_admitted_together_are_encoded_in_one_call(loaded, monkeypatch):
    pipe = loaded["flux"][1]
    calls: list[list[str]] = []
    encoder = pipe.text_encoder

    def spy(prompts):
        calls.append(list(prompts))
        return encoder(prompts)

    monkeypatch.setattr(pipe, "text_encoder", spy)
    requests = [request(p, s, 1.0, None) for p in PROMPTS for s in (5, 6)]
    together = [StepRequestState(request=r) for r in requests]
    pipe.prepare_encode_batch(together)
    assert len(calls) == 1 and len(calls[0]) == len(requests)
    for state in together:
        alone = StepRequestState(request=state.request)
        pipe.prepare_encode(alone)
        assert torch.allclose(alone.cond.embeds, state.cond.embeds, atol=1e-5)
        assert torch.equal(alone.latents, state.latents)


def test_the_prompt_cache_counts_only_what_an_encoder_call_did():
    from diffrt.engine.pipelines.prompt_cache import CachedTextEncoder

    calls = []

    def encoder(prompts):
        calls.append(list(prompts))
        if "boom" in prompts:
            raise RuntimeError("encoder failed")
        return torch.ones(len(prompts), 2, 3), torch.ones(len(prompts), 4)

    cache = CachedTextEncoder(encoder, max_bytes=1 << 20)
    cache(["a", "b", "a"])
    assert (cache.stats().encoded, cache.stats().cache_hits) == (2, 1)
    with pytest.raises(RuntimeError):
        cache(["c", "boom"])  # a failed call encoded nothing, and hit nothing
    assert (cache.stats().encoded, cache.stats().cache_hits) == (2, 1)
    cache(["b", "c"])
    assert (cache.stats().encoded, cache.stats().cache_hits) == (3, 2)
    assert calls == [["a", "b"], ["c", "boom"], ["c"]]
    off = CachedTextEncoder(encoder, max_bytes=0)  # keeps nothing, still counts
    off(["a"]), off(["a"])
    assert (off.stats().encoded, off.stats().cache_hits, len(off)) == (2, 0, 0)
