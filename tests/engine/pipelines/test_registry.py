"""Registry: names, local diffusers folders, hooks, the embedded folders in the cache."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from diffrt.engine.pipelines import (
    DiffusionPipeline,
    DiffusionRequestBatch,
    UnknownModelError,
    get_post_process_func,
    get_pre_process_func,
    known_models,
    load_pipeline,
    register_pipeline,
    registry,
    resolve_pipeline_class,
)
from diffrt.engine.pipelines.embedded import cache_dir, embedded_folder
from diffrt.engine.postprocess import quantize_images
from diffrt.engine.request import DiffusionRequest
from diffrt.engine.sampling import InvalidRequestError, SamplingParams


def request(**params) -> DiffusionRequest:
    params = {"height": 64, "width": 64, "num_inference_steps": 2, "seed": 0, **params}
    return DiffusionRequest("a lighthouse", SamplingParams(**params))


def weights_digest(pipe) -> str:
    h = hashlib.sha256()
    for module in (pipe.transformer, pipe.vae):
        for name, tensor in sorted(module.state_dict().items()):
            h.update(name.encode())
            h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def test_builtin_models_are_known():
    assert {"diffrt-shapes", "tiny-flux", "tiny-sd3"} <= set(known_models())
    for name in ("tiny-flux", "tiny-sd3"):
        cls = resolve_pipeline_class(name)
        assert cls.supports_request_batch and cls.supports_step_execution


def test_unknown_model_lists_known_names(tmp_path):
    with pytest.raises(UnknownModelError, match="tiny-flux") as info:
        resolve_pipeline_class("no-such-model")
    assert isinstance(info.value, ValueError) and "tiny-sd3" in str(info.value)
    with pytest.raises(UnknownModelError, match="model_index"):
        resolve_pipeline_class(str(tmp_path))  # an empty folder
    (tmp_path / "model_index.json").write_text(
        json.dumps({"transformer": ["diffusers", "UNet9000"]})
    )
    with pytest.raises(UnknownModelError, match="UNet9000"):
        resolve_pipeline_class(str(tmp_path))


def test_register_pipeline_and_hooks():
    class Constant(DiffusionPipeline):
        name = "constant"
        size_multiple = 8

        @classmethod
        def create(cls, *, device, dtype):
            pipe = cls()
            pipe.device, pipe.dtype = device, dtype
            return pipe

        def forward(self, batch):
            p = batch.sampling_params
            return [torch.zeros(1, 3, p.height, p.width) for _ in batch.requests]

    register_pipeline("test-constant", Constant)
    try:
        assert "test-constant" in known_models()
        pipe = load_pipeline("test-constant", dtype=torch.float16)
        assert isinstance(pipe, Constant) and pipe.dtype == torch.float16
        out = pipe.forward(DiffusionRequestBatch([request(height=24)]))[0]
        resolve_pipeline_class("test-constant").check_inputs(request(height=24))
        assert get_pre_process_func("test-constant")(r := request()) is r
        images, tensor = get_post_process_func("test-constant")(
            pipe.to_transfer(out, SamplingParams()), "pil"
        )
        assert tensor is None and images[0].size == (64, 24)
        assert images[0].getpixel((0, 0)) == (128, 128, 128)
    finally:
        registry._PIPELINES.pop("test-constant")


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-sd3"])
def test_an_embedded_model_is_a_folder_loaded_like_any_other(pipelines, tmp_path, model):
    """The embedded name and a copy of its folder elsewhere resolve to the same
    family and load the same weights: one code path for both."""
    folder = Path(embedded_folder(model))
    assert folder.parent == Path(os.environ["DIFFRT_CACHE_DIR"]) / "models"
    copy = tmp_path / model
    shutil.copytree(folder, copy)
    by_name, by_path = resolve_pipeline_class(model), resolve_pipeline_class(str(copy))
    assert by_name.name == model and by_path.name == str(copy.resolve())
    assert by_name.__mro__[1] is by_path.__mro__[1]  # the family class
    assert by_path.pretrained_path == str(copy.resolve())
    loaded = load_pipeline(str(copy))
    assert weights_digest(loaded) == weights_digest(pipelines[model])
    req = request(seed=3, guidance_scale=2.0)
    a = pipelines[model].forward(DiffusionRequestBatch([req]))[0]
    b = loaded.forward(DiffusionRequestBatch([req]))[0]
    assert torch.equal(quantize_images(a), quantize_images(b))


def test_local_sd3_folder_takes_its_limits_from_config():
    cls = resolve_pipeline_class(embedded_folder("tiny-sd3"))
    assert (cls.size_multiple, cls.max_size) == (16, 512)
    with pytest.raises(InvalidRequestError, match="height"):
        cls.check_inputs(request(height=1024))


def test_resolving_an_existing_folder_imports_no_diffusers():
    """Once the embedded folder is in the cache, resolving its name in another
    process reads JSON only: the engine validates requests without diffusers."""
    embedded_folder("tiny-flux")
    script = (
        "import sys\n"
        "from diffrt.engine.pipelines import resolve_pipeline_class\n"
        "from diffrt.engine.request import DiffusionRequest\n"
        "resolve_pipeline_class('tiny-flux').check_inputs(DiffusionRequest('x'))\n"
        "print('diffusers' in sys.modules, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["False", "False"]


def test_processes_racing_to_build_an_embedded_folder_share_one(tmp_path):
    """Three processes start at once on an empty cache: each builds into a
    temporary folder and renames it into place; all end with the same folder,
    byte-identical to this process's, and no temporary folder is left."""
    script = ("from diffrt.engine.pipelines.embedded import embedded_folder\n"
              "print(embedded_folder('tiny-sd3'))\n")
    env = {**os.environ, "DIFFRT_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(3)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    folders = {out.strip() for out, _ in outs}
    assert len(folders) == 1
    [folder] = folders
    assert sorted(os.listdir(tmp_path / "models")) == [os.path.basename(folder)]
    assert _tree_digest(Path(folder)) == _tree_digest(Path(embedded_folder("tiny-sd3")))


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("DIFFRT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == str(tmp_path / "xdg" / "diffrt")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == str(tmp_path / ".cache" / "diffrt")
    monkeypatch.setenv("DIFFRT_CACHE_DIR", "~/models-cache")
    assert cache_dir() == str(tmp_path / "models-cache")


def test_construction_leaves_the_callers_rng_alone(monkeypatch, tmp_path):
    monkeypatch.setenv("DIFFRT_CACHE_DIR", str(tmp_path))  # build, not only load
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    load_pipeline("tiny-sd3")
    assert torch.equal(torch.rand(3), expected)


def test_sampling_defaults_come_from_the_family_the_config_and_the_name(tmp_path):
    flux_copy = tmp_path / "flux"
    shutil.copytree(embedded_folder("tiny-flux"), flux_copy)
    # a Flux folder: FluxPipeline's defaults (128 latents x the VAE's 8, 28 steps, 3.5)
    assert resolve_pipeline_class(str(flux_copy)).sampling_defaults == {
        "height": 1024, "width": 1024, "num_inference_steps": 28, "guidance_scale": 3.5}
    # an SD3 folder: its transformer's sample_size (16 latents) x 8
    assert resolve_pipeline_class(embedded_folder("tiny-sd3")).sampling_defaults == {
        "height": 128, "width": 128, "num_inference_steps": 28, "guidance_scale": 7.0}
    # the embedded names: quick images
    assert resolve_pipeline_class("tiny-flux").sampling_defaults == {
        "height": 128, "width": 128, "num_inference_steps": 4, "guidance_scale": 3.5}
    assert resolve_pipeline_class("tiny-sd3").sampling_defaults["num_inference_steps"] == 4
    cls = resolve_pipeline_class("tiny-flux")
    filled = cls.with_defaults(DiffusionRequest("x", SamplingParams(width=64, seed=1)))
    assert (filled.sampling_params.height, filled.sampling_params.width) == (128, 64)
    assert filled.sampling_params.num_inference_steps == 4
    assert filled.sampling_params.true_cfg_scale == 1.0  # no model default: the fallback
    full = DiffusionRequest("x", SamplingParams(height=64, width=64, num_inference_steps=2,
                                                guidance_scale=1.0, true_cfg_scale=1.0))
    assert cls.with_defaults(full) is full


def test_a_broken_or_unwritable_cache_is_one_clear_error(monkeypatch, tmp_path):
    from diffrt.engine.pipelines.embedded import folder_key
    from diffrt.engine.pipelines.folder_check import ModelLoadError

    monkeypatch.setenv("DIFFRT_CACHE_DIR", str(tmp_path))
    # a folder of the right name that is not a model (say, copied half-way by hand)
    broken = tmp_path / "models" / f"tiny-sd3-{folder_key('tiny-sd3')}"
    broken.mkdir(parents=True)
    with pytest.raises(ModelLoadError, match="not a model folder") as info:
        embedded_folder("tiny-sd3")
    assert str(broken) in str(info.value)
    # a cache that cannot be created
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("DIFFRT_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(ModelLoadError, match="set DIFFRT_CACHE_DIR to a writable folder"):
        embedded_folder("tiny-sd3")


def test_builds_killed_midway_are_cleaned_up(monkeypatch, tmp_path):
    from diffrt.engine.pipelines import embedded

    monkeypatch.setenv("DIFFRT_CACHE_DIR", str(tmp_path))
    models = tmp_path / "models"
    stale, fresh = models / ".tiny-sd3-stale", models / ".tiny-sd3-inprogress"
    for folder in (stale, fresh):
        folder.mkdir(parents=True)
    old = time.time() - embedded.STALE_BUILD_S - 60
    os.utime(stale, (old, old))
    folder = embedded_folder("tiny-sd3")
    assert not stale.exists() and fresh.exists()  # a build in progress is left alone
    assert os.path.isfile(os.path.join(folder, "model_index.json"))


def test_the_folder_key_follows_the_builders_source(monkeypatch, tmp_path):
    from diffrt.engine.pipelines import embedded

    before = embedded.folder_key("tiny-flux")
    edited = tmp_path / "tiny_folders.py"
    edited.write_bytes(open(embedded._BUILDER_SOURCE, "rb").read() + b"\n# edited\n")
    monkeypatch.setattr(embedded, "_BUILDER_SOURCE", str(edited))
    assert embedded.folder_key("tiny-flux") != before
