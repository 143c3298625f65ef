"""LoRA adapters on tiny SD3 (CFG: both branches carry the row's adapters)
and tiny Qwen-Image (true CFG with a negative prompt): each request of a
step batch mixing two adapters and none gives diffusers' pixels after
``load_lora_weights`` + ``set_adapters`` for the same folder, prompt and seed.
The adapters are PEFT adapters with both factors random, saved by each
family's pipeline class (``lora_files``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lora_files import make_adapter

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams
from diffrt.engine.models.embedded import embedded_folder

MAX_DIFF = 2  # of 255, fp32
#: diffusers' pipeline holds several adapters at once by design here
pytestmark = pytest.mark.filterwarnings("ignore:Already found a `peft_config`:UserWarning")
SETS = [{"x": 1.0}, {"x": 0.5, "y": 1.0}, None]


def _folder(family: str, tmp_path_factory) -> str:
    if family == "sd3":
        return embedded_folder("tiny-sd3")
    from diffrt.engine.models.tiny.qwen_image import build_tiny_qwen_image_folder

    return str(build_tiny_qwen_image_folder(tmp_path_factory.mktemp("qwen") / "qwen", seed=0))


FAMILIES = {
    # pipeline class, size, steps, the request's extra fields, targets of x and y
    "sd3": ("StableDiffusion3Pipeline", 128, 3, {"guidance_scale": 5.0},
            ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "ff.net.2"), ("to_v", "ff.net.0.proj")),
    "qwen-image": ("QwenImagePipeline", 64, 3, {"true_cfg_scale": 4.0},
                   ("to_q", "to_k", "to_v", "to_out.0", "img_mlp.net.2", "txt_mlp.net.0.proj"),
                   ("to_v", "add_v_proj")),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_adapters_in_a_step_batch_match_diffusers(family, tmp_path_factory):
    import diffusers

    cls, size, steps, extra, x_targets, y_targets = FAMILIES[family]
    folder = _folder(family, tmp_path_factory)
    root = tmp_path_factory.mktemp(f"{family}-loras")
    files = {"x": make_adapter(folder, cls, root / "x", targets=x_targets, rank=4, seed=11,
                               magnitude=1.0),
             "y": make_adapter(folder, cls, root / "y", targets=y_targets, rank=8, alpha=4,
                               seed=12, magnitude=1.0)}
    negative = "blurry" if family == "qwen-image" else None

    pipe = getattr(diffusers, cls).from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    for name, path in files.items():
        pipe.load_lora_weights(path, adapter_name=name)

    def theirs(loras, seed):
        if loras:
            pipe.enable_lora()
            pipe.set_adapters(list(loras), list(loras.values()))
        else:
            pipe.disable_lora()
        image = pipe("a red fox in the snow", negative_prompt=negative, height=size, width=size,
                     num_inference_steps=steps, generator=torch.Generator().manual_seed(seed),
                     output_type="np", **extra).images[0]
        return (image * 255).round().astype(np.int16)

    with DiffusionEngine.make_engine(EngineConfig(
            model=folder, executor_backend="inproc", step_execution=True, max_num_seqs=3,
            warmup=False, lora_modules=files)) as engine:
        outs = engine.generate([DiffusionRequest(
            "a red fox in the snow", negative_prompt=negative, request_id=f"{family}-{i}",
            sampling_params=SamplingParams(height=size, width=size, num_inference_steps=steps,
                                           seed=30 + i, loras=loras, **extra))
            for i, loras in enumerate(SETS)], timeout=120)
    plain = None
    for i, (out, loras) in enumerate(zip(outs, SETS, strict=True)):
        assert out.ok, out.error
        got = np.asarray(out.images[0]).astype(np.int16)
        want = theirs(loras, 30 + i)
        assert np.abs(got - want).max() <= MAX_DIFF, (family, loras, np.abs(got - want).max())
        if loras is None:
            plain = theirs({"x": 1.0}, 30 + i)  # the same seed with an adapter differs
            assert np.abs(plain - got).mean() >= 10, np.abs(plain - got).mean()
