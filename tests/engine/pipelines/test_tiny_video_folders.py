"""The tiny video folders (``engine/models/tiny/``): built offline from fixed
seeds, byte-identical for one seed, and loaded and run by diffusers' own video
pipelines, so the video families are compared against diffusers on them."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from diffrt.engine.models.tiny.wan import BOUNDARY_RATIO, build_tiny_wan_folder

diffusers = pytest.importorskip("diffusers")


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def wan_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_wan")
    return {"t2v": build_tiny_wan_folder(root / "t2v", seed=1, two_experts=True),
            "i2v": build_tiny_wan_folder(root / "i2v", seed=1, i2v=True, two_experts=True)}


def _frames(pipeline, prompt: str, **kwargs) -> np.ndarray:
    pipeline.set_progress_bar_config(disable=True)
    out = pipeline(prompt=prompt, num_frames=9, height=64, width=64, num_inference_steps=4,
                   generator=torch.Generator().manual_seed(0), output_type="np", **kwargs)
    return out.frames[0]


def test_a_wan_folder_is_the_same_bytes_for_the_same_seed(tmp_path, wan_folders):
    again = build_tiny_wan_folder(tmp_path / "again", seed=1, two_experts=True)
    assert _digest(again) == _digest(wan_folders["t2v"])
    other = build_tiny_wan_folder(tmp_path / "other", seed=2, two_experts=True)
    assert (_digest(other)["transformer/diffusion_pytorch_model.safetensors"]
            != _digest(again)["transformer/diffusion_pytorch_model.safetensors"])


def test_diffusers_wan_pipeline_runs_the_folder_and_switches_experts_at_its_boundary(
        wan_folders):
    pipeline = diffusers.WanPipeline.from_pretrained(wan_folders["t2v"], local_files_only=True)
    assert pipeline.config.boundary_ratio == BOUNDARY_RATIO["t2v"]
    calls: list[tuple[str, float]] = []
    for name in ("transformer", "transformer_2"):
        getattr(pipeline, name).register_forward_pre_hook(
            lambda _m, _a, kw, name=name: calls.append((name, float(kw["timestep"][0]))),
            with_kwargs=True)
    frames = _frames(pipeline, "a red fox in the snow")
    assert frames.shape == (9, 64, 64, 3) and np.isfinite(frames).all()
    boundary = BOUNDARY_RATIO["t2v"] * pipeline.scheduler.config.num_train_timesteps
    # CFG: two calls a step, each to the expert its timestep falls to
    assert [name for name, t in calls] == [
        "transformer" if t >= boundary else "transformer_2" for _, t in calls]
    assert {name for name, _ in calls} == {"transformer", "transformer_2"}
    other = _frames(pipeline, "a blue square on green grass")
    assert np.abs(frames - other).mean() * 255 > 2.0  # the prompt shows in the frames


def test_diffusers_wan_image_to_video_pipeline_runs_the_i2v_folder(wan_folders):
    import PIL.Image

    pipeline = diffusers.WanImageToVideoPipeline.from_pretrained(
        wan_folders["i2v"], local_files_only=True)
    assert pipeline.transformer.config.in_channels == 36
    first = PIL.Image.fromarray(
        (np.random.default_rng(0).random((64, 64, 3)) * 255).astype(np.uint8))
    frames = _frames(pipeline, "a red fox", image=first)
    assert frames.shape == (9, 64, 64, 3) and np.isfinite(frames).all()


def test_diffusers_helios_pipeline_runs_the_folder_chunk_by_chunk(tmp_path):
    from diffrt.engine.models.tiny.helios import build_tiny_helios_folder

    folder = build_tiny_helios_folder(tmp_path / "helios", seed=1)
    pipeline = diffusers.HeliosPipeline.from_pretrained(folder, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    calls: list[int] = []
    pipeline.transformer.register_forward_pre_hook(
        lambda _m, _a, kw: calls.append(kw["hidden_states"].shape[2]), with_kwargs=True)
    # a chunk of 2 latent frames covers (2 - 1) x 4 + 1 = 5 frames: 13 frames are
    # 3 chunks, each 2 steps with CFG
    out = pipeline(prompt="a red fox", height=64, width=64, num_frames=13,
                   num_inference_steps=2, num_latent_frames_per_chunk=2,
                   history_sizes=[4, 2, 1], generator=torch.Generator().manual_seed(0))
    frames = out.frames[0]
    assert frames.shape[1:] == (64, 64, 3) and np.isfinite(frames).all()
    assert len(calls) == 3 * 2 * 2 and set(calls) == {2}


def test_a_ti2v_folder_is_refused_at_load_naming_expand_timesteps(tmp_path, wan_folders):
    """Wan 2.2 TI2V-5B (``expand_timesteps``: per-token timesteps) is not run
    by the wan family: resolving it is refused, naming the setting."""
    import json
    import shutil

    from diffrt.engine.models.folder_check import ModelLoadError
    from diffrt.engine.models.registry import resolve_model_spec

    folder = tmp_path / "ti2v"
    shutil.copytree(wan_folders["t2v"], folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "expand_timesteps": True}))
    assert resolve_model_spec(str(wan_folders["t2v"])).family == "wan"
    with pytest.raises(ModelLoadError, match="expand_timesteps"):
        resolve_model_spec(str(folder))
