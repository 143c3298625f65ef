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
    """The script as a module, its components at a toy size."""
    spec = importlib.util.spec_from_file_location("train_motion_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "VAE", {**module.VAE, "base_dim": 4})
    monkeypatch.setattr(module, "UMT5", {**module.UMT5, "d_model": 16, "d_kv": 8, "d_ff": 16,
                                          "num_layers": 1})
    monkeypatch.setattr(module, "TRANSFORMER", {
        **module.TRANSFORMER, "num_attention_heads": 2, "attention_head_dim": 12,
        "text_dim": 16, "freq_dim": 16, "ffn_dim": 24, "num_layers": 1})
    return module


def toy_args(train, tmp_path: Path, *extra: str):
    return train.parse(["--out", str(tmp_path / "m"), "--vae-steps", "2", "--steps", "3",
                        "--vae-batch", "2", "--batch", "2", "--cache-clips", "2",
                        "--variants", "1", "--threads", "1", *extra])


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
    assert run.cache is not None and run.cache["latents"].shape == (2, 8, 3, 16, 16)
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
    for name, module in whole.models.items():
        for (key, a), b in zip(module.state_dict().items(),
                               resumed.models[name].state_dict().values(), strict=True):
            assert torch.equal(a, b), (name, key)
