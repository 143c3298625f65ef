"""The features that run on video, through the engine (in-process executor)
on tiny-wan: step caches (threshold 0 gives the uncached frames, a high
threshold reuses steps, a cached request step-batched with another decides
as it does alone); LoRA per request (equal to diffusers' ``WanPipeline``
with ``load_lora_weights``, and batched beside a request without one; a
Wan 2.2 adapter for both experts equal to diffusers loading its two files
into ``transformer`` and ``transformer_2``); ``quantization="int8"`` and
``"fp8-storage"`` on both of Wan 2.2's experts (within each method's PSNR
bound of the float clip); the spec's TeaCache polynomial, the TeaCache
authors' for Wan 2.1 T2V folders, tiny-wan's fitted one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import assert_clean, shared_engine
from lora_files import make_adapter

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams
from diffrt.engine.models.embedded import embedded_folder

pytest.importorskip("diffusers")

#: 6 steps: the tiny folder's 4 leave TeaCache too few to skip after its first
STEPS = 6


def clip_request(seed: int, **params) -> DiffusionRequest:
    params.setdefault("num_inference_steps", STEPS)
    return DiffusionRequest(prompt=f"a red fox {seed}",
                            sampling_params=SamplingParams(seed=seed, **params))


#: the tiny text-to-video folder's attention and feed-forward linears
TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return make_adapter(embedded_folder("tiny-wan"), "WanPipeline",
                        tmp_path_factory.mktemp("wan-lora") / "a", targets=TARGETS, seed=3)


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """A Wan 2.2 adapter for both experts, as they are released: a folder of
    ``high_noise_model.safetensors`` (for ``transformer``) and
    ``low_noise_model.safetensors`` (for ``transformer_2``), each a file in
    diffusers' format."""
    import shutil

    root = tmp_path_factory.mktemp("wan-lora-experts")
    out = root / "both"
    out.mkdir()
    for name, seed in (("high_noise_model", 4), ("low_noise_model", 5)):
        made = make_adapter(embedded_folder("tiny-wan"), "WanPipeline", root / name,
                            targets=TARGETS, seed=seed)
        shutil.copy(f"{made}/pytorch_lora_weights.safetensors", out / f"{name}.safetensors")
    return str(out)


@pytest.fixture(scope="module")
def step(adapter, both):
    with shared_engine(DiffusionEngine.make_engine(EngineConfig(
            model="tiny-wan", executor_backend="inproc", warmup=False, step_execution=True,
            # rows with other adapters or caches share a step whatever the
            # cost model predicts: what a shared step computes is tested
            max_num_seqs=4, share_steps="always",
            lora_modules={"a": adapter, "both": both}))) as engine:
        yield engine


def clip(out) -> np.ndarray:
    assert out.ok, out.error
    return np.stack([np.asarray(f) for f in out.frames[0]]).astype(np.int16)


@pytest.mark.parametrize("policy,threshold", [("first-block", 0.9), ("teacache", 2.0)])
def test_a_cached_clip_at_threshold_zero_is_the_uncached_one_and_a_high_one_reuses(
        step, policy, threshold):
    plain = clip(step.generate(clip_request(5)))
    exact = step.generate(clip_request(5, cache=policy, cache_threshold=0.0))
    assert exact.metrics.cache.policy == policy
    assert exact.metrics.cache.steps_reused == 0
    assert np.array_equal(clip(exact), plain)
    cached = step.generate(clip_request(5, cache=policy, cache_threshold=threshold))
    assert cached.metrics.cache.steps_reused > 0
    assert cached.metrics.cache.steps_computed + cached.metrics.cache.steps_reused == STEPS
    assert np.abs(clip(cached) - plain).max() > 1
    assert_clean(step)


@pytest.mark.parametrize("policy,threshold", [("first-block", 0.9), ("teacache", 2.0)])
def test_a_cached_clip_step_batched_with_others_decides_as_alone(step, policy, threshold,
                                                                 caplog):
    cached = clip_request(6, cache=policy, cache_threshold=threshold)
    # a mate of 4 steps in its call (at its second step the rows fall to
    # different experts), and one of another frame count
    others = [clip_request(7, num_inference_steps=4),
              clip_request(8, num_frames=5, num_inference_steps=4)]
    alone = step.generate(cached)
    together = step.generate([cached, *others])
    assert alone.metrics.cache.steps_reused > 0
    assert together[0].metrics.cache.reused_steps == alone.metrics.cache.reused_steps
    assert np.abs(clip(together[0]) - clip(alone)).max() <= 1
    assert all(o.ok and o.metrics.cache is None for o in together[1:])
    assert not [r for r in caplog.records if "one at a time" in r.getMessage()]
    assert_clean(step)


def diffusers_clip(seed: int, load) -> np.ndarray:
    """diffusers' WanPipeline on tiny-wan, 4 steps, with adapters ``load(pipe)`` loads."""
    import diffusers

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny clip, as test_wan_family runs it
    try:
        pipe = diffusers.WanPipeline.from_pretrained(embedded_folder("tiny-wan"),
                                                     local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        load(pipe)
        return (pipe(prompt=f"a red fox {seed}", num_frames=9, height=64, width=64,
                     num_inference_steps=4, generator=torch.Generator("cpu").manual_seed(seed),
                     output_type="np").frames[0] * 255).round().astype(np.int16)
    finally:
        torch.set_num_threads(threads)


def test_a_lora_clip_matches_diffusers_and_batched_each_equals_alone(step, adapter, caplog):
    want = diffusers_clip(8, lambda pipe: pipe.load_lora_weights(adapter, adapter_name="a"))
    styled = clip_request(8, num_inference_steps=4, loras={"a": 1.0})
    plain = clip_request(8, num_inference_steps=4)
    alone = [clip(step.generate(r)) for r in (styled, plain)]
    assert np.abs(alone[0] - want).max() <= 2
    assert np.abs(alone[0] - alone[1]).mean() > 2  # the adapter shows
    # a mate of 6 steps: at some steps the two rows fall to different experts
    mate = clip_request(9, num_inference_steps=6)
    pair = [alone[0], clip(step.generate(mate))]
    together = [clip(o) for o in step.generate([styled, mate])]
    for got, solo in zip(together, pair, strict=True):
        assert np.abs(got - solo).max() <= 1
    # they shared their steps: no failed call run again a request at a time
    assert not [r for r in caplog.records if "one at a time" in r.getMessage()]
    assert_clean(step)


def test_a_lora_for_both_experts_matches_diffusers_loading_it_into_each(step, both):
    """The folder's high-noise file into ``transformer``, its low-noise file
    into ``transformer_2`` (``load_into_transformer_2=True``), as diffusers'
    ``load_lora_weights`` loads a Wan 2.2 adapter."""
    def load(pipe):
        pipe.load_lora_weights(both, weight_name="high_noise_model.safetensors",
                               adapter_name="high")
        pipe.load_lora_weights(both, weight_name="low_noise_model.safetensors",
                               adapter_name="low", load_into_transformer_2=True)

    want = diffusers_clip(11, load)
    got = clip(step.generate(clip_request(11, num_inference_steps=4, loras={"both": 1.0})))
    assert np.abs(got - want).max() <= 2
    # the low-noise file shows: without it (diffusers, the high file alone) the clip differs
    high_only = diffusers_clip(11, lambda pipe: pipe.load_lora_weights(
        both, weight_name="high_noise_model.safetensors", adapter_name="high"))
    assert np.abs(high_only - want).mean() > 1
    assert_clean(step)


@pytest.mark.parametrize("method", ["int8", "fp8-storage"])
def test_a_weight_method_converts_both_experts_within_its_psnr_of_the_float_clip(step, method):
    from test_weights import MIN_PSNR, psnr

    want = clip(step.generate(clip_request(10, num_inference_steps=4)))
    with DiffusionEngine.make_engine(EngineConfig(
            model="tiny-wan", executor_backend="inproc", warmup=False,
            quantization=method)) as engine:
        got = clip(engine.generate(clip_request(10, num_inference_steps=4)))
        methods = engine.weight_bytes.methods
        held = engine.weight_bytes.components
    floats = step.weight_bytes.components
    assert methods["transformer"] == methods["transformer_2"] == method
    # measured: each expert's linears converted (fp8-storage keeps diffusers'
    # skipped layers as loaded, the condition embedder's among them: on the
    # tiny folder 0.67 of the float bytes)
    share = {"int8": 0.4, "fp8-storage": 0.7}[method]
    for expert in ("transformer", "transformer_2"):
        assert held[expert]["cpu"] <= share * floats[expert]["cpu"]
    assert 0 < np.abs(got - want).max()  # converted: not the float bits
    assert psnr(got, want) >= MIN_PSNR[method], psnr(got, want)


def test_teacache_takes_the_published_or_fitted_polynomial(step):
    from diffrt.engine.models.family import ModelFolder
    from diffrt.engine.models.registry import resolve_model_spec
    from diffrt.engine.pipelines.wan.spec import WAN21_T2V_TEACACHE, teacache_rescale

    def folder(cls: str, layers: int, heads: int, second: list | None = None) -> ModelFolder:
        return ModelFolder("/nowhere", "wan", {"_class_name": cls,
                                               "transformer_2": second or [None, None]},
                           {"num_layers": layers, "num_attention_heads": heads})

    assert teacache_rescale(folder("WanPipeline", 30, 12), False) == WAN21_T2V_TEACACHE[(30, 12)]
    assert teacache_rescale(folder("WanPipeline", 40, 40), False) == WAN21_T2V_TEACACHE[(40, 40)]
    # Wan 2.2's experts, image-to-video and other shapes: uncalibrated
    assert teacache_rescale(folder("WanPipeline", 40, 40, ["diffusers", "x"]), False) == ()
    assert teacache_rescale(folder("WanImageToVideoPipeline", 40, 40), True) == ()
    assert teacache_rescale(folder("WanPipeline", 2, 2), False) == ()
    from diffrt.engine.models.embedded import TINY_WAN_TEACACHE

    # tiny-wan: the polynomial bench_cache.py fitted on its time embedding
    spec = resolve_model_spec("tiny-wan")
    assert set(spec.cache.policies) == {"first-block", "teacache"}
    assert spec.cache.teacache_rescale == TINY_WAN_TEACACHE
    # with it the policy's default threshold reuses a step (uncalibrated: none)
    out = step.generate(clip_request(5, cache="teacache"))
    assert out.ok and out.metrics.cache.steps_reused > 0
