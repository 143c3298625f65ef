"""Complete tiny diffusers folders (own CLIP/T5 encoders and tokenizers, built
locally): diffusers' own pipelines load them offline, run them deterministically,
and the prompt visibly changes the image."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffrt.engine.models.tiny.flux import build_tiny_flux_folder
from diffrt.engine.models.tiny.sd3 import build_tiny_sd3_folder
from diffrt.engine.models.tiny.shared import CLIP_MAX_LENGTH, T5_MAX_LENGTH

PROMPTS = ("a red fox in the snow", "portrait of an old man at sunset")
KINDS = ("flux", "sd3", "sd35")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_folders")
    return {
        "flux": build_tiny_flux_folder(root / "flux"),
        "sd3": build_tiny_sd3_folder(root / "sd3"),
        "sd35": build_tiny_sd3_folder(root / "sd35", sd35=True),
    }


@pytest.fixture(scope="module")
def pipes(folders):
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    loaded = {}
    for kind, folder in folders.items():
        cls = FluxPipeline if kind == "flux" else StableDiffusion3Pipeline
        pipe = cls.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        loaded[kind] = pipe
    return loaded


def generate(pipe, prompt: str, **kwargs) -> np.ndarray:
    if type(pipe).__name__ != "FluxPipeline":
        kwargs.setdefault("guidance_scale", 1.0)  # SD3 defaults to CFG 7
    out = pipe(prompt, height=64, width=64, num_inference_steps=2, output_type="np",
               generator=torch.Generator("cpu").manual_seed(0), **kwargs)
    return out.images[0]


def mean_abs_diff_255(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean() * 255)


@pytest.mark.parametrize("kind", KINDS)
def test_runs_and_repeats_exactly(pipes, kind):
    pipe = pipes[kind]
    first = generate(pipe, PROMPTS[0])
    assert first.shape == (64, 64, 3) and first.dtype == np.float32
    assert np.isfinite(first).all() and first.std() > 0.05
    np.testing.assert_array_equal(first, generate(pipe, PROMPTS[0]))


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_changes_the_image(pipes, kind):
    a, b = (generate(pipes[kind], prompt) for prompt in PROMPTS)
    assert mean_abs_diff_255(a, b) > 10


def test_sd3_cfg_with_negative_prompt(pipes):
    pipe = pipes["sd3"]
    guided = generate(pipe, PROMPTS[0], guidance_scale=2.0, negative_prompt="blurry, dark")
    assert np.isfinite(guided).all()
    assert mean_abs_diff_255(guided, generate(pipe, PROMPTS[0])) > 1
    np.testing.assert_array_equal(
        guided, generate(pipe, PROMPTS[0], guidance_scale=2.0, negative_prompt="blurry, dark"))


def test_tokenizers_load_with_their_classes(pipes, folders):
    from transformers import CLIPTokenizer, CLIPTokenizerFast, T5TokenizerFast

    clip_types = (CLIPTokenizer, CLIPTokenizerFast)
    assert isinstance(pipes["flux"].tokenizer, clip_types)
    assert isinstance(pipes["flux"].tokenizer_2, T5TokenizerFast)
    for kind in ("sd3", "sd35"):
        assert isinstance(pipes[kind].tokenizer, clip_types)
        assert isinstance(pipes[kind].tokenizer_2, clip_types)
        assert isinstance(pipes[kind].tokenizer_3, T5TokenizerFast)

    clip = CLIPTokenizer.from_pretrained(folders["flux"] / "tokenizer")
    t5 = T5TokenizerFast.from_pretrained(folders["flux"] / "tokenizer_2")
    assert (clip.model_max_length, t5.model_max_length) == (CLIP_MAX_LENGTH, T5_MAX_LENGTH)
    for tok, specials in ((clip, 2), (t5, 1)):
        ids = tok(PROMPTS[0]).input_ids
        assert len(set(ids)) == len(ids) == 6 + specials  # one token per word
        assert tok.decode(ids, skip_special_tokens=True) == PROMPTS[0]
        padded = tok([PROMPTS[0]], padding="max_length", max_length=20, truncation=True,
                     return_tensors="pt").input_ids
        assert padded.shape == (1, 20)
        assert padded[0, len(ids):].eq(tok.pad_token_id).all()
    assert clip.pad_token_id == clip.eos_token_id == len(clip) - 1  # CLIP pools at the eos
    assert (t5.pad_token_id, t5.eos_token_id, t5.unk_token_id) == (0, 1, 2)


def test_shapes_line_up(pipes):
    flux = pipes["flux"]
    assert flux.transformer.config.joint_attention_dim == flux.text_encoder_2.config.d_model
    assert flux.transformer.config.pooled_projection_dim == flux.text_encoder.config.hidden_size
    assert flux.transformer.config.in_channels == 4 * flux.vae.config.latent_channels
    for kind in ("sd3", "sd35"):
        pipe = pipes[kind]
        clip_width = pipe.text_encoder.config.hidden_size + pipe.text_encoder_2.config.hidden_size
        t5_width = pipe.text_encoder_3.config.d_model
        assert pipe.transformer.config.joint_attention_dim == t5_width > clip_width
        assert pipe.transformer.config.pooled_projection_dim == (
            pipe.text_encoder.config.projection_dim + pipe.text_encoder_2.config.projection_dim)
    assert pipes["sd35"].transformer.config.qk_norm == "rms_norm"
    assert list(pipes["sd35"].transformer.config.dual_attention_layers) == [0]
    assert not pipes["sd3"].scheduler.config.use_dynamic_shifting
    assert flux.scheduler.config.use_dynamic_shifting


def _files(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes(folders, tmp_path):
    again = {"flux": build_tiny_flux_folder(tmp_path / "flux"),
             "sd3": build_tiny_sd3_folder(tmp_path / "sd3")}
    for kind, folder in again.items():
        before, after = _files(folders[kind]), _files(folder)
        assert sorted(before) == sorted(after)
        weights = [name for name in before if name.endswith(".safetensors")]
        assert len(weights) == (4 if kind == "flux" else 5)
        for name in before:
            assert before[name] == after[name], name


def test_other_seed_other_weights(folders, tmp_path):
    other = build_tiny_flux_folder(tmp_path / "flux", seed=1)
    name = "transformer/diffusion_pytorch_model.safetensors"
    assert (other / name).read_bytes() != (folders["flux"] / name).read_bytes()
    # the tokenizers do not depend on the seed
    assert _files(other / "tokenizer") == _files(folders["flux"] / "tokenizer")


def test_sd3_text_encoders_differ(folders):
    name = "model.safetensors"
    sd3 = folders["sd3"]
    assert (sd3 / "text_encoder" / name).read_bytes() != (sd3 / "text_encoder_2" / name).read_bytes()


def test_flux_guidance_embeds(tmp_path):
    from diffusers import FluxPipeline

    folder = build_tiny_flux_folder(tmp_path / "flux", guidance_embeds=True)
    pipe = FluxPipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.transformer.config.guidance_embeds
    low, high = (generate(pipe, PROMPTS[0], guidance_scale=g) for g in (1.0, 3.5))
    assert mean_abs_diff_255(low, high) > 1
