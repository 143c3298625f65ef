"""scripts/train_motion_model.py at a toy size (its components shrunk, the
data and the losses its own): a few optimiser steps on one batch lower the
VAE's and the transformer's losses, and a run stopped at a checkpoint and
resumed takes the same steps to the bit as one that was never stopped."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from diffrt.demo import motion

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_motion_model.py"


@pytest.fixture()
def train(monkeypatch):
    """The script as a module, its components at a toy size, on one torch
    thread (as its ``--threads 1``; on a shared 2-core machine two threads
    made the toy steps ten times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("train_motion_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "VAE", {**module.VAE, "base_dim": 4})
    monkeypatch.setattr(module, "UMT5", {**module.UMT5, "d_model": 16, "d_kv": 8, "d_ff": 16,
                                          "num_layers": 1})
    monkeypatch.setattr(module, "TRANSFORMER", {
        **module.TRANSFORMER, "num_attention_heads": 2, "attention_head_dim": 12,
        "rope_dim": (4, 4, 4), "text_dim": 16, "freq_dim": 16, "ffn_dim": 24, "num_layers": 1})
    yield module
    torch.set_num_threads(threads)


def toy_argv(tmp_path: Path, *extra: str) -> list[str]:
    return ["--out", str(tmp_path / "m"), "--vae-steps", "2", "--steps", "3", "--vae-batch", "2",
            "--batch", "2", "--cache-clips", "2", "--variants", "1", "--threads", "1", *extra]


def toy_args(train, tmp_path: Path, *extra: str):
    return train.parse(toy_argv(tmp_path, *extra))


def steps(run, loss_of, optimiser, count: int = 4) -> list[float]:
    """``count`` steps on one fixed batch (the data and noise generators reset)."""
    losses = []
    for _ in range(count):
        torch.manual_seed(0)
        run.rng = np.random.default_rng(0)
        loss = loss_of()
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    return losses


def test_a_few_steps_on_one_batch_lower_both_losses(train, tmp_path):
    run = train.Run(toy_args(train, tmp_path), lambda _: None)
    clips = [motion.TRAIN[0], motion.TRAIN[500]]
    vae_losses = steps(run, lambda: run.vae_loss(clips), run.vae_opt)
    assert all(map(math.isfinite, vae_losses)) and vae_losses[-1] < vae_losses[0], vae_losses
    run.build_cache()
    # the default 2x in time: 9 frames are 5 latent frames
    assert run.cache is not None and run.cache["latents"].shape == (2, 8, 5, 16, 16)
    for group in run.opt.param_groups:
        group["lr"] = 3e-3
    picks = np.arange(2)
    prompts = [motion.TRAIN[int(i)].prompt for i in run.cache["index"]]
    losses = steps(run, lambda: run.transformer_loss(picks, prompts), run.opt)
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses


def test_a_resumed_run_takes_the_steps_of_one_never_stopped(train, tmp_path):
    whole = train.Run(toy_args(train, tmp_path / "a"), lambda _: None)
    assert whole.train_vae()
    whole.build_cache()
    assert whole.train_transformer()

    cut = train.Run(toy_args(train, tmp_path / "b"), lambda _: None)
    cut.out_of_time = lambda: cut.vae_step >= 2 and cut.step >= 1  # stopped after one step
    assert cut.train_vae()
    cut.build_cache()
    assert not cut.train_transformer()
    cut.save()
    resumed = train.Run(toy_args(train, tmp_path / "b", "--resume"), lambda _: None)
    resumed.restore()
    assert resumed.train_vae()  # nothing left to do
    resumed.build_cache()  # read back from the work folder
    assert resumed.train_transformer()
    assert resumed.vae_losses == whole.vae_losses and len(whole.losses) == 3
    assert resumed.losses == whole.losses
    for name, module in [*whole.models.items(), ("probe", whole.probe)]:
        theirs = resumed.probe if name == "probe" else resumed.models[name]
        for (key, a), b in zip(module.state_dict().items(), theirs.state_dict().values(),
                               strict=True):
            assert torch.equal(a, b), (name, key)


def test_the_written_folder_is_a_helios_folder_diffusers_and_diffrt_draw_alike(train, tmp_path):
    """The whole script at a toy size (2 VAE and 3 transformer steps): the
    folder, its evaluation and model card; diffusers' HeliosPipeline and
    diffrt load it and draw the same clip within 2/255 (the model is
    untrained: its content is not judged). By path, not as diffrt-motion,
    the folder's chunks are Helios' own 9 latent frames: 17 frames here."""
    import diffusers

    from diffrt.engine.pipelines import DiffusionRequestBatch, load_pipeline
    from diffrt.engine.postprocess import quantize_images
    from diffrt.engine.request import DiffusionRequest
    from diffrt.engine.sampling import SamplingParams

    assert train.main(toy_argv(tmp_path, "--eval-count", "1")) == 0
    folder = tmp_path / "m"
    table = (folder / "evaluation.json").read_text(encoding="utf-8")
    assert '"accuracy"' in table and '"loss_curve"' in table
    card = (folder / "README.md").read_text(encoding="utf-8")
    assert "diffusers.HeliosPipeline.from_pretrained" in card and "| direction | colour |" in card
    pipe = diffusers.HeliosPipeline.from_pretrained(folder, local_files_only=True,
                                                    torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.transformer.dtype == torch.float32  # stored in float16, loaded as asked
    prompt = motion.EVALUATION[0].prompt
    assert pipe.tokenizer.model_max_length == train.PROMPT_TOKENS  # diffrt pads to it too
    sampling = {**train.EVAL, "num_frames": 17}
    want = pipe(prompt, negative_prompt="", output_type="np", max_sequence_length=16,
                generator=torch.Generator().manual_seed(0), **sampling).frames[0]
    ours = load_pipeline(str(folder))
    video = ours.forward(DiffusionRequestBatch([DiffusionRequest(
        prompt=prompt, request_id="toy", sampling_params=SamplingParams(seed=0, **sampling))]))[0]
    got = quantize_images(video)[0].numpy().astype(np.int16)
    assert got.shape == (17, 64, 64, 3)
    assert np.abs(got - (want * 255).round().astype(np.int16)).max() <= 2


@pytest.mark.parametrize("time_compression, latent_frames", [(4, 3), (2, 5), (1, 9)])
def test_the_time_compression_sets_the_latent_frames_and_their_weights(
        train, time_compression, latent_frames):
    """``--time-compression``: the VAE makes 3, 5 or 9 latent frames of a
    9-frame clip, and the shape's token weights have a frame for each, the
    first frame's from the first frame alone (a clip moving left to right:
    its shape sits at the left there, so the right half weighs 1)."""
    models = train.build_models(32, 2, time_compression)
    clip = next(c for c in motion.TRAIN if c.direction == "left to right")
    videos = train.clips_tensor([motion.render(clip)])
    with torch.no_grad():
        latents = models["vae"].encode(videos).latent_dist.mode()
        assert models["vae"].decode(latents).sample.shape[2] == motion.FRAMES
    weights = train.token_weights(videos, [clip], time_compression)
    assert latents.shape[2] == weights.shape[1] == latent_frames
    # each latent frame's weights are its own frames': the first frame alone,
    # then groups of time_compression
    shape = train.shape_mask(videos, [clip])
    for k in range(latent_frames):
        frames = shape[0, :1] if k == 0 else shape[0, 1 + (k - 1) * time_compression:
                                                      1 + k * time_compression]
        cells = torch.nn.functional.max_pool2d(frames.amax(0)[None, None], 4)[0, 0]
        assert ((weights[0, k] > 1) >= (cells > 0)).all()
    assert models["vae"].config.scale_factor_temporal == time_compression
    assert weights[0, 0].max() > 1 and (weights[0, 0, :, 8:] == 1).all()
    assert (weights[0, -1, :, 8:] > 1).any()  # the last frames: the shape on the right
