"""A family from outside diffrt (tests/plugins/stripes_family) follows the
"Adding a family" checklist: registered through ``plugin_modules``, with its
own spec and folder builder and a pipeline on the flow-match contract
(docs/families.md), it runs through the shared denoise loop and is served
like a built-in family, batched requests equal to their runs alone."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from diffrt.engine import (
    DiffusionEngine,
    DiffusionRequest,
    EngineConfig,
    EngineConfigError,
    InvalidRequestError,
    SamplingParams,
)
from diffrt.engine.pipelines import DiffusionRequestBatch, load_pipeline, resolve_model_spec

PLUGIN = "plugins.stripes_family"
TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from plugins.stripes_family.tiny_folder import build_stripes_folder

    return str(build_stripes_folder(tmp_path_factory.mktemp("stripes") / "stripes", seed=3))


def requests(tag: str) -> list[DiffusionRequest]:
    shapes = [(16, 16, 3), (16, 16, 5), (16, 16, 2), (16, 16, 3)]
    return [DiffusionRequest(f"{tag} {i}", SamplingParams(height=h, width=w,
                                                          num_inference_steps=s, seed=i),
                             request_id=f"{tag}-{i}") for i, (h, w, s) in enumerate(shapes)]


def alone(folder: str, request: DiffusionRequest) -> np.ndarray:
    from diffrt.engine.postprocess import quantize_images

    pipe = load_pipeline(folder)
    [out] = pipe.forward(DiffusionRequestBatch([request]))
    return quantize_images(out)[0].numpy()


def test_the_family_is_unknown_until_its_plugin_is_imported(folder):
    was = sys.modules.pop(PLUGIN, None)
    from diffrt.engine.models import registry

    registry._FAMILIES.pop("stripes", None)
    try:
        with pytest.raises(EngineConfigError,
                           match="_class_name 'StripesPipeline' is not a diffusers pipeline"):
            EngineConfig(model=folder, executor_backend="inproc").model_spec()
        config = EngineConfig(model=folder, executor_backend="inproc", plugin_modules=[PLUGIN])
        spec = config.model_spec()
        assert (spec.family, spec.size_multiple, spec.max_size) == ("stripes", 4, 64)
    finally:
        if was is not None:
            sys.modules.setdefault(PLUGIN, was)


@pytest.mark.parametrize("step_execution", [False, True])
def test_a_plugin_family_is_served_batched_and_each_request_equals_its_run_alone(
        folder, step_execution):
    config = EngineConfig(model=folder, plugin_modules=[PLUGIN], executor_backend="inproc",
                          step_execution=step_execution, max_num_seqs=4, warmup=False,
                          request_batch_max_wait_ms=50, step_batch_max_wait_ms=50)
    with DiffusionEngine.make_engine(config) as engine:
        batch = requests(f"step{step_execution}")
        outs = engine.generate(batch, timeout=60)
        assert all(o.ok for o in outs), [o.error for o in outs]
        for request, out in zip(batch, outs, strict=True):
            assert out.total_steps == request.sampling_params.num_inference_steps
            np.testing.assert_array_equal(np.asarray(out.images[0]), alone(folder, request))
        with pytest.raises(InvalidRequestError, match="multiple of 4"):  # its spec's limit
            engine.generate(DiffusionRequest("x", SamplingParams(height=18)))
    spec = resolve_model_spec(folder)
    assert spec.defaults.num_inference_steps == 3


@pytest.mark.parametrize("step_execution", [False, True])
def test_the_plugin_family_runs_through_the_shared_denoise_loop(folder, step_execution,
                                                                 monkeypatch):
    """The family supplies only the contract's parts: every transformer call
    comes through the shared loop (``DenoiseLoop.forward`` or
    ``denoise_step``, by mode) and the feature layers (``CALL_LAYERS`` down
    to ``FamilyCall``), each request's row once a step."""
    from diffrt.engine.pipelines.denoise import DenoiseLoop
    from diffrt.engine.pipelines.flow_match import FlowMatchPipeline
    from diffrt.engine.pipelines.transformer_call import FamilyCall

    rows, entries = [], []
    family_call = FamilyCall.__call__

    def spy(self, call):
        assert isinstance(self.host, FlowMatchPipeline)
        assert type(self.host).__name__ == "StripesPipeline"
        rows.append(tuple(call.latents.shape))
        return family_call(self, call)

    monkeypatch.setattr(FamilyCall, "__call__", spy)
    def entering(name):
        inner = getattr(DenoiseLoop, name)

        def entry(self, *args):
            entries.append(name)
            return inner(self, *args)
        return entry

    for name in ("forward", "denoise_step"):
        monkeypatch.setattr(DenoiseLoop, name, entering(name))
    config = EngineConfig(model=folder, plugin_modules=[PLUGIN], executor_backend="inproc",
                          step_execution=step_execution, max_num_seqs=4, warmup=False,
                          request_batch_max_wait_ms=50, step_batch_max_wait_ms=50)
    batch = requests(f"loop{step_execution}")
    with DiffusionEngine.make_engine(config) as engine:
        outs = engine.generate(batch, timeout=60)
    assert all(o.ok for o in outs), [o.error for o in outs]
    assert set(entries) == {"denoise_step" if step_execution else "forward"}
    # 16 x 16 pixels, a latent a 4 x 4 block: 16 tokens of 3 channels a row
    assert {shape[1:] for shape in rows} == {(16, 3)}
    assert sum(shape[0] for shape in rows) == sum(
        r.sampling_params.num_inference_steps for r in batch)


def test_the_plugin_family_image_depends_on_seed_prompt_and_steps(folder):
    base = DiffusionRequest("a", SamplingParams(height=16, width=16, num_inference_steps=3,
                                                seed=1))
    image = alone(folder, base)
    for other in (DiffusionRequest("a", SamplingParams(height=16, width=16,
                                                       num_inference_steps=3, seed=2)),
                  DiffusionRequest("b", SamplingParams(height=16, width=16,
                                                       num_inference_steps=3, seed=1)),
                  DiffusionRequest("a", SamplingParams(height=16, width=16,
                                                       num_inference_steps=4, seed=1))):
        assert not np.array_equal(image, alone(folder, other))
    assert np.array_equal(image, alone(folder, base))


def test_adding_the_family_touches_no_file_under_diffrt():
    """The plugin is one package: nothing under ``diffrt/`` names it."""
    root = Path(__file__).resolve().parents[2] / "diffrt"
    named = [str(path) for path in root.rglob("*.py")
             if "stripes" in path.read_text(encoding="utf-8").lower()]
    assert named == []


def test_its_workers_import_the_plugin_too(folder):
    """Spawned workers start fresh: plugin_modules is imported in each."""
    config = EngineConfig(model=folder, plugin_modules=[PLUGIN], warmup=False,
                          worker_env={"PYTHONPATH": str(TESTS)})
    with DiffusionEngine.make_engine(config) as engine:
        [request] = requests("mp")[:1]
        out = engine.generate(request, timeout=120)
        assert out.ok, out.error
        np.testing.assert_array_equal(np.asarray(out.images[0]), alone(folder, request))
