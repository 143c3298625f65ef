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

from diffrt.engine.model_spec import CfgRule, ModelSpec, SamplingDefaults
from diffrt.engine.models.embedded import cache_dir, embedded_folder
from diffrt.engine.pipelines import (
    DiffusionPipeline,
    DiffusionRequestBatch,
    UnknownModelError,
    known_models,
    load_pipeline,
    register_model,
    resolve_model_spec,
    unregister_model,
)
from diffrt.engine.postprocess import output_postprocessor, quantize_images
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
        spec = resolve_model_spec(name)
        assert spec.supports_request_batch and spec.supports_step_execution


def test_unknown_model_lists_known_names(tmp_path):
    with pytest.raises(UnknownModelError, match="tiny-flux") as info:
        resolve_model_spec("no-such-model")
    assert isinstance(info.value, ValueError) and "tiny-sd3" in str(info.value)
    with pytest.raises(UnknownModelError, match="model_index"):
        resolve_model_spec(str(tmp_path))  # an empty folder
    (tmp_path / "model_index.json").write_text(
        json.dumps({"transformer": ["diffusers", "UNet9000"]})
    )
    with pytest.raises(UnknownModelError, match="UNet9000"):
        resolve_model_spec(str(tmp_path))


def test_the_family_is_the_pipeline_class_the_folder_names(tmp_path):
    """model_index.json's ``_class_name`` decides the family and what it
    serves: a Kontext index edits; a pipeline class no family serves that
    shares Flux's transformer class (Fill) is refused, not run as
    text-to-image Flux; an index without ``_class_name`` falls back to its
    transformer class."""
    folder = tmp_path / "kontext"
    shutil.copytree(embedded_folder("tiny-flux"), folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index,
                                                         "_class_name": "FluxKontextPipeline"}))
    spec = resolve_model_spec(str(folder))
    assert (spec.diffusers_pipeline, spec.tasks) == ("FluxKontextPipeline",
                                                     ("text-to-image", "editing"))
    fill = tmp_path / "fill"  # another folder: a folder's spec is resolved once
    shutil.copytree(folder, fill)
    (fill / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxFillPipeline"}))
    with pytest.raises(UnknownModelError, match="unsupported pipeline class FluxFillPipeline"):
        resolve_model_spec(str(fill))
    del index["_class_name"]
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    (bare / "model_index.json").write_text(json.dumps(index))
    spec = resolve_model_spec(str(bare))
    assert (spec.family, spec.diffusers_pipeline) == ("flux", "FluxPipeline")


class Constant(DiffusionPipeline):
    """A folder-less model: its pipeline builds its own (no) weights."""

    @classmethod
    def load(cls, spec, *, device, dtype):
        pipe = cls()
        pipe.spec, pipe.device, pipe.dtype = spec, device, dtype
        return pipe

    def forward(self, batch):
        p = batch.sampling_params
        return [torch.zeros(1, 3, p.height, p.width) for _ in batch.requests]


def test_register_model_and_its_spec():
    spec = ModelSpec(name="test-constant", family="constant",
                     pipeline=f"{__name__}:Constant", size_multiple=8, max_size=64,
                     defaults=SamplingDefaults(height=16, width=16, num_inference_steps=1,
                                               guidance_scale=1.0))
    register_model(spec)
    try:
        assert "test-constant" in known_models()
        assert resolve_model_spec("test-constant") is spec
        pipe = load_pipeline("test-constant", dtype=torch.float16)
        assert isinstance(pipe, Constant) and pipe.dtype == torch.float16
        assert pipe.spec is spec and pipe.name == "test-constant"
        out = pipe.forward(DiffusionRequestBatch([request(height=24)]))[0]
        spec.check(request(height=24))
        with pytest.raises(InvalidRequestError, match="height: must be a positive multiple of 8"):
            spec.check(request(height=20))
        with pytest.raises(InvalidRequestError, match="no larger than 64"):
            spec.check(request(height=72))
        images, tensor = output_postprocessor(spec)(
            pipe.to_transfer(out, SamplingParams()), "pil")
        assert tensor is None and images[0].size == (64, 24)
        assert images[0].getpixel((0, 0)) == (128, 128, 128)
    finally:
        unregister_model("test-constant")


def test_the_pipeline_contract_is_compute_only():
    """What a request may ask is the spec's: the pipeline class answers none
    of the engine's questions, and the second names of the hooks are gone."""
    from diffrt.engine.models import registry
    from diffrt.engine.pipelines.flux.pipeline import FluxPipeline

    for name in ("check_inputs", "with_defaults", "uses_cfg", "request_batch_key",
                 "step_batch_key", "check_parallel", "pre_process", "post_process",
                 "sampling_defaults", "size_multiple", "max_size", "negative_prompt",
                 "default_negative_prompt", "supports_request_batch",
                 "supports_step_execution", "cfg_scale"):
        assert not hasattr(DiffusionPipeline, name), name
        assert not hasattr(FluxPipeline, name), name
    assert not hasattr(registry, "get_pre_process_func")
    assert not hasattr(registry, "get_post_process_func")
    assert not hasattr(registry, "resolve_pipeline_class")


def test_a_spec_is_plain_data_that_travels(tmp_path):
    """The worker receives the engine's spec in its settings: it survives
    msgpack unchanged, and its decisions are data (the CFG rule)."""
    import msgspec

    spec = resolve_model_spec("diffrt-shapes")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(spec), type=ModelSpec) == spec
    assert spec.cfg_rule is CfgRule.TRUE_CFG_AND_NEGATIVE
    assert resolve_model_spec("tiny-sd3").cfg_rule is CfgRule.GUIDANCE_GT_1
    with pytest.raises(AttributeError):
        spec.max_size = 1  # frozen


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-sd3"])
def test_an_embedded_model_is_a_folder_loaded_like_any_other(pipelines, tmp_path, model):
    """The embedded name and a copy of its folder elsewhere resolve to the same
    family and load the same weights: one code path for both."""
    folder = Path(embedded_folder(model))
    assert folder.parent == Path(os.environ["DIFFRT_CACHE_DIR"]) / "models"
    copy = tmp_path / model
    shutil.copytree(folder, copy)
    by_name, by_path = resolve_model_spec(model), resolve_model_spec(str(copy))
    assert by_name.name == model and by_path.name == str(copy.resolve())
    assert by_name.pipeline == by_path.pipeline and by_name.family == by_path.family
    assert by_path.folder == str(copy.resolve())
    loaded = load_pipeline(str(copy))
    assert weights_digest(loaded) == weights_digest(pipelines[model])
    req = request(seed=3, guidance_scale=2.0)
    a = pipelines[model].forward(DiffusionRequestBatch([req]))[0]
    b = loaded.forward(DiffusionRequestBatch([req]))[0]
    assert torch.equal(quantize_images(a), quantize_images(b))


def test_local_sd3_folder_takes_its_limits_from_config():
    spec = resolve_model_spec(embedded_folder("tiny-sd3"))
    assert (spec.size_multiple, spec.max_size) == (16, 512)
    with pytest.raises(InvalidRequestError, match="height"):
        spec.check(request(height=1024))


def test_resolving_an_existing_folder_imports_no_diffusers():
    """Once the embedded folder is in the cache, resolving its name in another
    process reads JSON only: the engine validates requests without diffusers."""
    embedded_folder("tiny-flux")
    script = (
        "import sys\n"
        "from diffrt.engine.pipelines import resolve_model_spec\n"
        "from diffrt.engine.request import DiffusionRequest\n"
        "resolve_model_spec('tiny-flux').check(DiffusionRequest('x'))\n"
        "print('diffusers' in sys.modules, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["False", "False"]


def test_processes_racing_to_build_an_embedded_folder_share_one(tmp_path):
    """Three processes start at once on an empty cache: each builds into a
    temporary folder and renames it into place; all end with the same folder,
    byte-identical to this process's, and no temporary folder is left."""
    script = ("from diffrt.engine.models.embedded import embedded_folder\n"
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
    assert resolve_model_spec(str(flux_copy)).defaults == SamplingDefaults(
        height=1024, width=1024, num_inference_steps=28, guidance_scale=3.5)
    # an SD3 folder: its transformer's sample_size (16 latents) x 8
    assert resolve_model_spec(embedded_folder("tiny-sd3")).defaults == SamplingDefaults(
        height=128, width=128, num_inference_steps=28, guidance_scale=7.0)
    # the embedded names: quick images
    assert resolve_model_spec("tiny-flux").defaults == SamplingDefaults(
        height=128, width=128, num_inference_steps=4, guidance_scale=3.5)
    assert resolve_model_spec("tiny-sd3").defaults.num_inference_steps == 4
    cls = resolve_model_spec("tiny-flux")
    filled = cls.with_defaults(DiffusionRequest("x", SamplingParams(width=64, seed=1)))
    assert (filled.sampling_params.height, filled.sampling_params.width) == (128, 64)
    assert filled.sampling_params.num_inference_steps == 4
    assert filled.sampling_params.true_cfg_scale == 1.0  # the family's: no true CFG
    full = DiffusionRequest("x", SamplingParams(height=64, width=64, num_inference_steps=2,
                                                guidance_scale=1.0, true_cfg_scale=1.0))
    assert cls.with_defaults(full) is full


def test_a_named_models_cache_calibration_lands_on_its_family_description(tmp_path):
    """The registry entry's thresholds and TeaCache polynomial (what the
    benchmark fitted for that checkpoint) replace the family's calibration of
    those fields only; the same folder under another path has the family's."""
    from diffrt.engine.cache.policies import DEFAULT_THRESHOLDS
    from diffrt.engine.models.embedded import EMBEDDED_MODELS
    from diffrt.engine.models.shipped import SHIPPED_MODELS

    calibrated = {**EMBEDDED_MODELS, **SHIPPED_MODELS}
    assert all(calibrated[name].cache for name in ("tiny-flux", "tiny-sd3", "diffrt-shapes"))
    flux_copy = tmp_path / "flux"
    shutil.copytree(embedded_folder("tiny-flux"), flux_copy)
    family = resolve_model_spec(str(flux_copy)).cache
    assert family.teacache_rescale == () and family.thresholds == {}
    for name in ("tiny-flux", "tiny-sd3", "diffrt-shapes"):
        entry, spec = calibrated[name].cache, resolve_model_spec(name)
        assert spec.cache.policies == ("first-block", "teacache")
        assert spec.cache.default is None  # cache=None stays off
        assert spec.cache.teacache_rescale == tuple(entry.get("teacache_rescale", ()))
        for policy in spec.cache.policies:
            plan = spec.cache_plan(SamplingParams(cache=policy))
            assert plan is not None
            assert plan.threshold == entry.get("thresholds", {}).get(policy, DEFAULT_THRESHOLDS[policy])
            assert plan.rescale == (spec.cache.teacache_rescale if policy == "teacache" else ())
            own = spec.cache_plan(SamplingParams(cache=policy, cache_threshold=0.05))
            assert own is not None and own.threshold == 0.05
        assert spec.cache_plan(SamplingParams()) is None


def test_a_broken_or_unwritable_cache_is_one_clear_error(monkeypatch, tmp_path):
    from diffrt.engine.models.embedded import folder_key
    from diffrt.engine.models.folder_check import ModelLoadError

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
    from diffrt.engine.models import embedded

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


def test_the_folder_key_follows_the_builders_source(tmp_path):
    """A folder's key covers its builder's module and the shared pieces:
    editing either builds anew."""
    from diffrt.engine.models import embedded

    sources = embedded.builder_sources("tiny-flux")
    assert [os.path.relpath(p, os.path.dirname(embedded.SHARED_SOURCE)) for p in sources] == [
        "flux.py", "shared.py"]
    assert embedded.builder_sources("tiny-sd3")[0].endswith(os.path.join("tiny", "sd3.py"))
    before = embedded.folder_key("tiny-flux")
    assert before == embedded._folder_key("tiny-flux", sources)
    for i, path in enumerate(sources):
        edited = tmp_path / f"{i}-{os.path.basename(path)}"
        edited.write_bytes(open(path, "rb").read() + b"\n# edited\n")
        changed = (*sources[:i], str(edited), *sources[i + 1:])
        assert embedded._folder_key("tiny-flux", changed) != before, path
