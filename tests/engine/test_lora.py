"""LoRA adapters per request on tiny-flux: pixels equal to diffusers'
``load_lora_weights`` + ``set_adapters``, requests with different adapters
(or none) sharing one forward / one step with each equal to its run alone,
a constant number of matmuls per layer whatever the adapters, run-time
registration and removal while requests run, device slots in rotation, and
the files refused at registration.

The adapters are made offline (``lora_files``): PEFT adapters with both
factors random, saved by diffusers, and a kohya-format file diffusers converts.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from engine_helpers import assert_shared_steps
from lora_files import make_adapter, make_kohya_flux, make_xlabs_flux

from diffrt.engine import (
    AdapterFileError,
    DiffusionEngine,
    DiffusionRequest,
    EngineConfig,
    InvalidRequestError,
    LoraExistsError,
    SamplingParams,
)
from diffrt.engine.models.embedded import embedded_folder
from diffrt.engine.pipelines.flux.spec import LORA_TARGET_MODULES
from diffrt.engine.runner_messages import AdapterState, AdapterStatus

PROMPT = "a red square on a blue field"
#: diffusers' pipeline holds several adapters at once by design here
pytestmark = pytest.mark.filterwarnings("ignore:Already found a `peft_config`:UserWarning")


def runner_of(engine: DiffusionEngine):
    """The in-process worker's pipeline runner."""
    return engine.executor.core.runner


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> adapter path: a (every target, rank 4), b (three layers,
    rank 8, alpha 16), k (kohya), x (XLabs), c (rank 2, for run-time
    registration)."""
    folder = embedded_folder("tiny-flux")
    root = tmp_path_factory.mktemp("loras")
    return {
        "a": make_adapter(folder, "FluxPipeline", root / "a", targets=LORA_TARGET_MODULES,
                          rank=4, seed=1),
        "b": make_adapter(folder, "FluxPipeline", root / "b", targets=("to_q", "to_v", "ff.net.2"),
                          rank=8, alpha=16, seed=2),
        "k": make_kohya_flux(folder, root / "k" / "style.safetensors", seed=3, magnitude=1.5),
        "x": make_xlabs_flux(folder, root / "x" / "xlabs.safetensors", seed=5),
        "c": make_adapter(folder, "FluxPipeline", root / "c", targets=("to_v", "proj_mlp", "ff.net.2"),
                          rank=2, seed=4, magnitude=2.0),
    }


@pytest.fixture(scope="module")
def step_engine(files):
    config = EngineConfig(model="tiny-flux", executor_backend="inproc", step_execution=True,
                          max_num_seqs=4, max_steps_per_tick=1, share_steps="always",
                          lora_modules={n: files[n] for n in ("a", "b", "k", "x")})
    with DiffusionEngine.make_engine(config) as engine:
        yield engine


@pytest.fixture(scope="module")
def request_engine(files):
    config = EngineConfig(model="tiny-flux", executor_backend="inproc", max_num_seqs=4,
                          request_batch_max_wait_ms=200,
                          lora_modules={n: files[n] for n in ("a", "b", "k", "x")})
    with DiffusionEngine.make_engine(config) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(files):
    """diffusers' FluxPipeline over the same folder with the adapters loaded:
    loras -> its image (uint8 array)."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(embedded_folder("tiny-flux"))
    pipe.set_progress_bar_config(disable=True)
    for name in ("a", "b", "k", "x"):
        pipe.load_lora_weights(files[name], adapter_name=name)

    def image(loras: dict[str, float] | None, seed: int = 7, steps: int = 4) -> np.ndarray:
        if loras:
            pipe.enable_lora()
            pipe.set_adapters(list(loras), list(loras.values()))
        else:
            pipe.disable_lora()
        out = pipe(PROMPT, height=128, width=128, num_inference_steps=steps, guidance_scale=3.5,
                   generator=torch.Generator().manual_seed(seed)).images[0]
        return np.asarray(out, dtype=np.int16)

    return image


def request(rid: str, loras: dict[str, float] | None, *, seed: int = 7,
            steps: int = 4) -> DiffusionRequest:
    return DiffusionRequest(prompt=PROMPT, request_id=rid, sampling_params=SamplingParams(
        seed=seed, loras=loras, num_inference_steps=steps))


def pixels(output) -> np.ndarray:
    assert output.ok, output.error
    return np.asarray(output.images[0], dtype=np.int16)


SETS = [None, {"a": 1.0}, {"a": 0.5}, {"a": 0.5, "b": 1.0}, {"k": 1.0}, {"x": 1.0}]


@pytest.mark.parametrize("mode", ["step", "request"])
def test_each_adapter_set_matches_diffusers(mode, step_engine, request_engine, reference):
    engine = step_engine if mode == "step" else request_engine
    plain = pixels(engine.generate(request(f"{mode}-none", None)))
    for i, loras in enumerate(SETS):
        mine = pixels(engine.generate(request(f"{mode}-solo-{i}", loras)))
        theirs = reference(loras)
        assert np.abs(mine - theirs).max() <= 2, (loras, np.abs(mine - theirs).max())
        if loras:  # every adapter moves the image (a B of zeros would not)
            assert np.abs(mine - plain).mean() >= 10, (loras, np.abs(mine - plain).mean())


@pytest.mark.parametrize("mode", ["step", "request"])
def test_a_batch_of_adapter_sets_gives_each_its_own_image(mode, step_engine, request_engine):
    """Three adapter sets and no adapter in one batch: each image equals the
    request's run alone (and, in step mode, the four really shared steps)."""
    engine = step_engine if mode == "step" else request_engine
    sets = [{"a": 1.0}, {"b": 1.0}, {"a": 0.5, "k": 1.0}, None]
    alone = [pixels(engine.generate(request(f"{mode}-alone-{i}", s, seed=20 + i)))
             for i, s in enumerate(sets)]
    before, forwards = engine.stats().step_batch_rows, engine.stats().step_time_s.count
    together = engine.generate([request(f"{mode}-mixed-{i}", s, seed=20 + i)
                                for i, s in enumerate(sets)])
    for i, out in enumerate(together):
        assert np.abs(pixels(out) - alone[i]).max() <= 1, sets[i]
    if mode == "step":
        assert_shared_steps(before, engine.stats().step_batch_rows, rows=4, steps=4)
    else:  # one fused forward for the four
        assert engine.stats().step_time_s.count - forwards == 1


def test_matmuls_per_layer_do_not_depend_on_the_adapters_in_a_step(files):
    """One denoise step of four rows costs the same matmul calls whether the
    rows hold one adapter or three different ones (gathered per row, never a
    loop over adapters); rows without adapters add none."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from diffrt.engine.lora.adapter_file import read_adapter
    from diffrt.engine.pipelines.interface import StepRequestState
    from diffrt.engine.pipelines.load import load_pipeline

    spec = EngineConfig(model="tiny-flux").model_spec()
    pipe = load_pipeline(spec, device=torch.device("cpu"), dtype=torch.float32)
    linears = pipe.enable_loras(4)
    for slot, name in enumerate(("a", "b", "k")):
        pipe.row_loras.install(slot, slot + 1, read_adapter(
            files[name], "FluxPipeline", linears, spec.lora_target_modules))

    class Matmuls(TorchDispatchMode):
        ops = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default,
               torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default}

        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += func in self.ops
            return func(*args, **(kwargs or {}))

    def calls(loras: list[tuple]) -> int:
        states = [StepRequestState(request=request(f"m{i}", None, seed=i)) for i in range(4)]
        pipe.prepare_encode_batch(states)
        for state, uses in zip(states, loras, strict=True):
            state.loras = uses
        with Matmuls() as mode:
            pipe.denoise_step(states)
        return mode.calls

    none = calls([(), (), (), ()])
    one = calls([((0, 1.0),), (), (), ()])
    three = calls([((0, 1.0),), ((1, 0.5),), ((2, 1.0), (0, 0.3)), ()])
    hooked = len(pipe.row_loras.tables)
    assert one == three == none + 2 * hooked


def test_adapters_added_and_removed_while_requests_run(step_engine, files, reference):
    """A run-time adapter serves at once; removed while its requests run,
    they finish with its pixels, later requests naming it are refused, and
    its weights leave the workers once they ended; the name can come back."""
    info = step_engine.add_lora("c", files["c"])
    assert (info.name, info.rank, info.slot) == ("c", 2, None)
    with pytest.raises(LoraExistsError):
        step_engine.add_lora("c", files["c"])
    alone = pixels(step_engine.generate(request("c-alone", {"c": 1.0}, steps=12)))
    assert np.abs(alone - pixels(step_engine.generate(request("c-none", None, steps=12)))
                  ).mean() >= 10
    results = {}
    runner = threading.Thread(target=lambda: results.update(
        out=step_engine.generate([request(f"c-run-{i}", {"c": 1.0}, steps=12)
                                  for i in range(2)])))
    runner.start()
    deadline = time.monotonic() + 30
    while step_engine.stats().requests_running < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    [adapter_id] = [a.id for a in step_engine.adapters.registered() if a.name == "c"]
    step_engine.remove_lora("c")
    with pytest.raises(InvalidRequestError) as refused:
        step_engine.generate(request("c-late", {"c": 1.0}))
    assert refused.value.field == "loras"
    runner.join(60)
    for out in results["out"]:
        assert np.abs(pixels(out) - alone).max() <= 1
    assert "c" not in [i.name for i in step_engine.list_loras()]
    # its last request ended: the worker holds it no longer (neither host nor slot)
    [state] = step_engine.executor.collective_rpc(AdapterStatus(adapter_id))
    assert "never asked" in state.state
    assert adapter_id not in [e and e[0] for e in runner_of(step_engine).pipeline.row_loras.installed]
    with pytest.raises(KeyError):
        step_engine.remove_lora("c")
    step_engine.add_lora("c", files["c"])  # a new adapter under the old name
    assert np.abs(pixels(step_engine.generate(request("c-again", {"c": 1.0}, steps=12)))
                  - alone).max() <= 1
    step_engine.remove_lora("c")


def test_one_device_slot_serves_three_adapters_in_rotation(files):
    """max_loras=1: requests for three adapters wait for the slot in turn and
    each gets its own adapter's pixels; the slot was loaded and evicted."""
    config = EngineConfig(model="tiny-flux", executor_backend="inproc", step_execution=True,
                          max_num_seqs=4, max_loras=1, warmup=False,
                          lora_modules={n: files[n] for n in ("a", "b", "k")})
    with DiffusionEngine.make_engine(config) as engine:
        names = ["a", "b", "k", "a", None, "k"]
        alone = {n: pixels(engine.generate(request(f"alone-{n}", {n: 1.0} if n else None)))
                 for n in ("a", "b", "k", None)}
        outs = engine.generate([request(f"rot-{i}", {n: 1.0} if n else None)
                                for i, n in enumerate(names)])
        for name, out in zip(names, outs, strict=True):
            assert np.abs(pixels(out) - alone[name]).max() <= 1, name
        stats = engine.stats()
        assert stats.lora_slots == 1 and stats.lora_slots_used == 1
        assert stats.lora_loads_total >= 5 and stats.lora_evictions_total >= 4
        assert stats.lora_requests_total == {"a": 3, "b": 2, "k": 3}  # alone + rotation
        with pytest.raises(InvalidRequestError, match="max_loras=1"):
            engine.generate(request("two", {"a": 1.0, "b": 1.0}))


def test_files_that_are_not_adapters_for_this_model_are_refused(step_engine, tmp_path, files):
    from safetensors.torch import save_file

    text = tmp_path / "notes.safetensors"
    text.write_text("not a tensor file")
    encoder = tmp_path / "with_text_encoder.safetensors"
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 32),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(32, 2),
               "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight":
                   torch.ones(2, 32),
               "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight":
                   torch.ones(32, 2)}, str(encoder))
    wide = tmp_path / "wide.safetensors"
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 64),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(64, 2)},
              str(wide))
    def pair(module: str, out_features: int, in_features: int) -> dict[str, torch.Tensor]:
        return {f"transformer.{module}.lora_A.weight": torch.ones(2, in_features),
                f"transformer.{module}.lora_B.weight": torch.ones(out_features, 2)}

    qwen = tmp_path / "qwen_layers.safetensors"  # Qwen-Image's layer names
    save_file(pair("transformer_blocks.0.img_mlp.net.2", 32, 128), str(qwen))
    embedder = tmp_path / "embedder.safetensors"  # a layer the spec keeps adapters off
    save_file(pair("time_text_embed.timestep_embedder.linear_2", 32, 32), str(embedder))
    cases = {tmp_path / "missing.safetensors": "no such file",
             text: "not a LoRA file", encoder: "text_encoder",
             wide: "do not fit", qwen: "not a linear layer", embedder: "may target"}
    for path, why in cases.items():
        with pytest.raises(AdapterFileError) as refused:
            step_engine.add_lora("bad", str(path))
        assert str(path) in str(refused.value) and why in str(refused.value), refused.value
    assert "bad" not in [i.name for i in step_engine.list_loras()]
    with pytest.raises(InvalidRequestError, match="no adapter named 'nope'"):
        step_engine.generate(request("unknown", {"nope": 1.0}))
    assert step_engine.generate(request("after", {"a": 1.0})).ok  # it serves on


def test_a_slow_adapter_read_does_not_stop_the_steps(files, tmp_path):
    """The file is read on the worker's loader thread (the plugin holds the
    read until the test lets it go): a request submitted meanwhile runs to
    its end first."""
    import shutil

    import plugin_slow_lora

    slow = tmp_path / "slow-lora"
    shutil.copytree(files["b"], slow)
    config = EngineConfig(model="tiny-flux", executor_backend="inproc", step_execution=True,
                          max_num_seqs=2, warmup=False, plugin_modules=("plugin_slow_lora",))
    plugin_slow_lora.hold()
    try:
        with DiffusionEngine.make_engine(config) as engine:
            adder = threading.Thread(target=engine.add_lora, args=("slow", str(slow)))
            adder.start()
            assert plugin_slow_lora.reading.wait(60)  # the read is under way
            out = engine.generate(request("meanwhile", None, steps=4), timeout=120)
            assert out.ok and adder.is_alive()  # served while the read is still held
            plugin_slow_lora.release()
            adder.join(60)
            assert not adder.is_alive()
            assert engine.generate(request("slow-used", {"slow": 1.0})).ok
    finally:
        plugin_slow_lora.release()


def test_fresh_workers_read_the_registered_adapters_again(step_engine):
    """The workers a restart starts (``restart_workers``) are given every
    registered adapter before they serve: their slots start empty."""
    fresh = step_engine._fresh_executor()
    try:
        for info in step_engine.list_loras():
            adapter_id = next(a.id for a in step_engine.adapters.registered()
                              if a.name == info.name)
            [state] = fresh.collective_rpc(AdapterStatus(adapter_id))
            assert state == AdapterState("ready", rank=info.rank, modules=info.modules,
                                      nbytes=info.nbytes)
    finally:
        fresh.shutdown()


def test_a_slot_that_could_not_be_filled_fails_its_request_alone(files, monkeypatch):
    """The worker cannot copy an adapter into its slot (say, out of memory):
    the request naming it fails alone (its batch mate without an adapter is
    served), the engine forgets the assignment, and the next request with
    that adapter gets the slot filled and its pixels."""
    config = EngineConfig(model="tiny-flux", executor_backend="inproc", step_execution=True,
                          max_num_seqs=2, max_steps_per_tick=1, warmup=False,
                          lora_modules={"a": files["a"]})
    with DiffusionEngine.make_engine(config) as engine:
        good = pixels(engine.generate(request("first", {"a": 1.0})))
        slots = runner_of(engine).pipeline.row_loras
        slots.clear(0)
        engine.adapters.slots_empty([0])  # the next request installs it again ...
        real_install = slots.install

        def out_of_memory(*args):
            raise torch.OutOfMemoryError("no room for the adapter")

        monkeypatch.setattr(slots, "install", out_of_memory)  # ... and that fails
        failed, plain = engine.generate([request("fails", {"a": 1.0}), request("plain", None)])
        assert not failed.ok and "does not hold adapter" in failed.error
        assert plain.ok
        assert engine.stats().lora_slots_used == 0
        monkeypatch.setattr(slots, "install", real_install)
        assert np.abs(pixels(engine.generate(request("again", {"a": 1.0}))) - good).max() <= 1


def test_cached_requests_with_adapters_decide_as_they_do_alone(step_engine):
    """Adapters and step caches in one step batch: a request's rows that skip
    blocks take their adapters with them (the sub-batch of the rows that
    compute carries only theirs), each decides and draws as alone."""
    specs = [({"a": 1.0}, "first-block", 0.5), ({"b": 1.0}, None, None),
             (None, "teacache", 1.0), ({"a": 0.5, "k": 1.0}, "first-block", 0.5)]

    def cached(rid: str, loras, policy, threshold, seed: int) -> DiffusionRequest:
        return DiffusionRequest(prompt=PROMPT, request_id=rid, sampling_params=SamplingParams(
            seed=seed, loras=loras, num_inference_steps=6, cache=policy,
            cache_threshold=threshold))

    alone = [step_engine.generate(cached(f"cache-alone-{i}", *s, seed=40 + i))
             for i, s in enumerate(specs)]
    together = step_engine.generate([cached(f"cache-mixed-{i}", *s, seed=40 + i)
                                     for i, s in enumerate(specs)])
    for (loras, policy, _), got, want in zip(specs, together, alone, strict=True):
        assert np.abs(pixels(got) - pixels(want)).max() <= 1, loras
        if policy is None:
            assert got.metrics.cache is None
            continue
        assert got.metrics.cache.steps_reused > 0
        assert got.metrics.cache.reused_steps == want.metrics.cache.reused_steps
