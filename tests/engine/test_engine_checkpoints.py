"""The engine on complete tiny diffusers folders gives diffusers' own pixels:
request and step mode, several requests batched, in-process and with worker
processes, the folder's own text encoders included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams
from diffrt.engine.models.tiny.flux import build_tiny_flux_folder
from diffrt.engine.models.tiny.sd3 import build_tiny_sd3_folder

SIZE, STEPS = 64, 3
MAX_DIFF = 2  # of 255, fp32


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {"flux": build_tiny_flux_folder(root / "flux", seed=1),
            "sd3": build_tiny_sd3_folder(root / "sd3", seed=1)}


@pytest.fixture(scope="module")
def references(folders):
    """diffusers' images for every case, computed once."""
    import diffusers

    pipes = {"flux": diffusers.FluxPipeline.from_pretrained(folders["flux"], local_files_only=True),
             "sd3": diffusers.StableDiffusion3Pipeline.from_pretrained(folders["sd3"],
                                                                       local_files_only=True)}
    out = {}
    for family, kw in CASES:
        for prompt, seed in PROMPT_SEEDS:
            image = pipes[family](prompt, height=SIZE, width=SIZE, num_inference_steps=STEPS,
                                  generator=torch.Generator("cpu").manual_seed(seed),
                                  output_type="np", **kw).images[0]
            out[family, _label(kw), prompt, seed] = (image * 255).round().astype(np.int16)
    return out


PROMPT_SEEDS = [("a red fox in the snow", 0), ("a blue circle", 1), ("a red fox in the snow", 2)]
CASES = [("flux", {"guidance_scale": 1.0}),
         ("flux", {"true_cfg_scale": 3.0, "negative_prompt": "blurry"}),
         ("sd3", {"guidance_scale": 1.0}),
         ("sd3", {"guidance_scale": 2.5, "negative_prompt": "blurry"})]


def _label(kw: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(kw.items()))


def _requests(kw: dict) -> list[DiffusionRequest]:
    negative = kw.get("negative_prompt")
    params = {k: v for k, v in kw.items() if k != "negative_prompt"}
    return [DiffusionRequest(prompt=p, negative_prompt=negative, sampling_params=SamplingParams(
        height=SIZE, width=SIZE, num_inference_steps=STEPS, seed=s, **params))
        for p, s in PROMPT_SEEDS]


def _pixels(out) -> np.ndarray:
    assert out.ok, out.error
    return np.asarray(out.images[0]).astype(np.int16)


@pytest.mark.parametrize("step", [False, True], ids=["request", "step"])
@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_engine_matches_diffusers_alone_and_batched(folders, references, family, step):
    config = EngineConfig(model=str(folders[family]), executor_backend="inproc",
                          step_execution=step, max_num_seqs=4, warmup=False)
    with DiffusionEngine.make_engine(config) as engine:
        for fam, kw in CASES:
            if fam != family:
                continue
            requests = _requests(kw)
            batched = engine.generate(requests)            # submitted together: batched
            alone = [engine.generate(r) for r in requests]
            for r, together, single in zip(requests, batched, alone, strict=True):
                want = references[family, _label(kw), r.prompt, r.sampling_params.seed]
                for out in (together, single):
                    assert np.abs(_pixels(out) - want).max() <= MAX_DIFF, (kw, r.prompt)
                    assert out.seed == r.sampling_params.seed


@pytest.mark.e2e
def test_engine_with_worker_processes_matches_diffusers(folders, references):
    kw = CASES[1][1]  # Flux with true CFG and a negative prompt
    config = EngineConfig(model=str(folders["flux"]), step_execution=True, max_num_seqs=4)
    with DiffusionEngine.make_engine(config) as engine:
        outs = engine.generate(_requests(kw))
    for (prompt, seed), out in zip(PROMPT_SEEDS, outs, strict=True):
        want = references["flux", _label(kw), prompt, seed]
        assert np.abs(_pixels(out) - want).max() <= MAX_DIFF


def test_fields_left_unset_take_diffusers_defaults(folders):
    """A request that sets only its prompt and seed gets the image diffusers'
    pipeline gives with its own defaults (SD3: the transformer's sample size,
    28 steps, guidance 7.0 with CFG)."""
    import diffusers

    pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(folders["sd3"],
                                                              local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    want = pipe("a red fox", generator=torch.Generator("cpu").manual_seed(5),
                output_type="np").images[0]
    want = (want * 255).round().astype(np.int16)
    config = EngineConfig(model=str(folders["sd3"]), executor_backend="inproc", warmup=False)
    with DiffusionEngine.make_engine(config) as engine:
        out = engine.generate(DiffusionRequest("a red fox", SamplingParams(seed=5)))
    assert want.shape == (128, 128, 3)  # sample_size 16 latents x 8
    assert np.abs(_pixels(out) - want).max() <= MAX_DIFF
    assert out.total_steps == 28
