"""Weight updates without a restart (docs/rollouts.md) on tiny-flux, in-process.

After ``update_weights`` outputs are bit-identical to a fresh engine loaded
with those weights and carry the new version; a request running when the
update arrives finishes on its old weights (or is aborted with
``policy="abort"``); a rank whose checksum differs from the source's refuses
the update and the old weights stay; ``update_lora`` gives what registering
the new factors gives, versioned.
"""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest
import torch
from lora_files import make_adapter
from waiting import wait_until

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams
from diffrt.engine.models.embedded import embedded_folder
from diffrt.engine.weight_sync import WeightsMismatchError
from diffrt.engine.weights import update as update_module
from diffrt.engine.weights.update import WeightUpdateError

TARGETS = ("to_q", "to_k", "to_v", "proj_mlp")
TRANSFORMER_FILE = "diffusion_pytorch_model.safetensors"


def request(seed: int = 1, steps: int = 3, **kw) -> DiffusionRequest:
    return DiffusionRequest(prompt="a red square", sampling_params=SamplingParams(
        height=64, width=64, num_inference_steps=steps, seed=seed, **kw))


def pixels(out) -> np.ndarray:
    assert out.ok, out.error
    return np.stack([np.asarray(image) for image in out.images])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny-flux folder, a copy whose transformer weights are perturbed
    (seeded), and two adapters of the same configuration (other seeds)."""
    from safetensors.torch import load_file, save_file

    original = embedded_folder("tiny-flux")
    root = tmp_path_factory.mktemp("weights")
    changed = root / "tiny-flux-changed"
    shutil.copytree(original, changed)
    tensors = load_file(str(changed / "transformer" / TRANSFORMER_FILE))
    generator = torch.Generator().manual_seed(7)
    perturbed = {name: t + 0.05 * torch.randn(t.shape, generator=generator).to(t.dtype)
                 for name, t in tensors.items()}
    save_file(perturbed, str(changed / "transformer" / TRANSFORMER_FILE))
    adapters = {name: make_adapter(original, "FluxPipeline", root / name, targets=TARGETS,
                                   rank=4, alpha=8, seed=seed)
                for name, seed in (("a", 1), ("b", 2))}
    return {"original": original, "changed": str(changed), "tensors": tensors,
            "perturbed": perturbed, **adapters}


def make(model: str, **kw) -> DiffusionEngine:
    return DiffusionEngine.make_engine(EngineConfig(
        model=model, executor_backend="inproc", step_execution=True, max_num_seqs=4,
        warmup=False, max_request_seconds=None, **kw))


@pytest.fixture(scope="module")
def engine(folders):
    with make("tiny-flux", lora_modules={"a": folders["a"], "b": folders["b"]}) as e:
        yield e


@pytest.fixture(scope="module")
def before(engine):
    """What the engine draws on its weights as loaded (version 0)."""
    out = engine.generate(request())
    assert out.weights_version == 0
    return pixels(out)


def restore(engine, folders) -> None:
    engine.update_weights(folders["tensors"], version=0)


def test_an_update_equals_a_fresh_engine_with_those_weights(engine, folders, before):
    assert engine.update_weights(folders["changed"] + "/transformer", version="v1") == "v1"
    try:
        out = engine.generate(request())
        assert out.weights_version == "v1" and engine.weights_version == "v1"
        with make(folders["changed"]) as fresh:
            want = pixels(fresh.generate(request()))
        assert np.array_equal(pixels(out), want)
        assert not np.array_equal(pixels(out), before)
    finally:
        restore(engine, folders)
    back = engine.generate(request())  # a mapping, through shared memory
    assert back.weights_version == 0 and np.array_equal(pixels(back), before)


def run_in_thread(engine, req):
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("out", engine.generate(req)))
    thread.start()
    wait_until(lambda: engine.stats().requests_running >= 1 or "out" in result,
               message="the long request never ran")
    return thread, result


def test_a_running_request_finishes_on_its_old_weights(engine, folders):
    long = request(seed=3, steps=10)
    reference = pixels(engine.generate(request(seed=3, steps=10)))
    thread, result = run_in_thread(engine, long)
    try:
        version = engine.update_weights(folders["perturbed"])
        thread.join()
        out = result["out"]
        assert out.weights_version == 0 and np.array_equal(pixels(out), reference)
        after = engine.generate(request(seed=3, steps=10))
        assert after.weights_version == version == 1
        assert not np.array_equal(pixels(after), reference)
    finally:
        thread.join()
        restore(engine, folders)


def test_policy_abort_aborts_the_running_request(engine, folders):
    thread, result = run_in_thread(engine, request(seed=4, steps=100))
    try:
        engine.update_weights(folders["perturbed"], version="aborting", policy="abort")
        thread.join()
        assert result["out"].aborted
        assert engine.generate(request()).weights_version == "aborting"
    finally:
        thread.join()
        restore(engine, folders)


def test_a_checksum_mismatch_keeps_the_old_weights(engine, folders, before, monkeypatch):
    """One rank (here the only one) reports a checksum other than the
    source's: refused, nothing changes."""
    monkeypatch.setattr(update_module, "checksum", lambda tensors: "0badc0de")
    with pytest.raises(WeightsMismatchError, match="0badc0de"):
        engine.update_weights(folders["perturbed"], version="never")
    monkeypatch.undo()
    out = engine.generate(request())
    assert out.weights_version == 0 and engine.weights_version == 0
    assert np.array_equal(pixels(out), before)


def test_a_kept_update_rolls_back_bit_for_bit_to_its_version(engine, folders, before):
    """What a Ray Serve replica does when an update reached only some
    replicas: ``keep_previous`` then ``revert_weights``."""
    engine.update_weights(folders["perturbed"], version="kept")  # not kept: no copy
    try:
        kept = pixels(engine.generate(request()))
        done = engine.update_weights_report(folders["tensors"], version="v2",
                                            keep_previous=True)
        assert done.version == engine.weights_version == "v2"
        assert np.array_equal(pixels(engine.generate(request())), before)
        assert not np.array_equal(before, kept)
        assert engine.revert_weights() == "kept"
        out = engine.generate(request())
        assert out.weights_version == "kept" and np.array_equal(pixels(out), kept)
        with pytest.raises(WeightUpdateError, match="no previous weights"):
            engine.revert_weights()  # rolled back once: nothing kept any more
        engine.update_weights(folders["tensors"], version=0)
        with pytest.raises(WeightUpdateError, match="no previous weights"):
            engine.revert_weights()  # the last update kept nothing
        engine.update_weights_report(folders["perturbed"], version=3, keep_previous=True)
        engine.forget_previous_weights()
        with pytest.raises(WeightUpdateError, match="no previous weights"):
            engine.revert_weights()
        assert engine.weights_version == 3
    finally:
        restore(engine, folders)
    assert np.array_equal(pixels(engine.generate(request())), before)


def test_a_source_the_model_cannot_take_is_refused(engine, folders, before):
    with pytest.raises(WeightUpdateError, match="does not have"):
        engine.update_weights({"no.such.weight": torch.zeros(2)})
    name = next(iter(folders["tensors"]))
    with pytest.raises(WeightUpdateError, match="shape"):
        engine.update_weights({name: torch.zeros(3, 1)})
    assert np.array_equal(pixels(engine.generate(request())), before)


def test_update_lora_gives_what_registering_the_factors_gives(engine, folders):
    from safetensors.torch import load_file

    with_b = pixels(engine.generate(request(loras={"b": 1.0})))
    with_a = engine.generate(request(loras={"a": 1.0}))
    assert with_a.lora_versions == {"a": 0}
    assert not np.array_equal(pixels(with_a), with_b)
    factors = load_file(f"{folders['b']}/pytorch_lora_weights.safetensors")
    info = engine.update_lora("a", factors)
    assert info.version == 1
    out = engine.generate(request(loras={"a": 1.0}))
    assert out.lora_versions == {"a": 1}
    assert np.array_equal(pixels(out), with_b)
    engine.update_lora("a", folders["a"], version="original")  # a path works too
    back = engine.generate(request(loras={"a": 1.0}))
    assert back.lora_versions == {"a": "original"}
    assert np.array_equal(pixels(back), pixels(with_a))


def test_requests_wait_while_the_engine_sleeps(engine, before):
    """CPU: sleep frees nothing (the host is the device) but is accepted; a
    request submitted meanwhile waits, unadmitted, until ``wake``, then
    draws what it drew before."""
    report = engine.sleep(level=1)
    assert engine.sleeping and report.freed_bytes == 0
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("out", engine.generate(request())))
    thread.start()
    try:
        wait_until(lambda: engine.stats().requests_waiting == 1, message="never queued")
        assert engine.stats().requests_running == 0 and "out" not in result
        engine.wake()
        thread.join()
    finally:
        if engine.sleeping:
            engine.wake()
        thread.join()
    assert not engine.sleeping
    assert np.array_equal(pixels(result["out"]), before)


def test_shared_folders_of_a_process_that_is_gone_are_swept(tmp_path):
    """A Ray Serve replica killed before its engine closed leaves its updated
    adapters' files in /dev/shm: the next process that makes a shared folder
    removes those of gone processes of its pid namespace, and no other."""
    import os
    import subprocess
    import sys

    from diffrt.engine.weight_sync import SHARED_PREFIX, shared_dir, sweep_orphans

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    mine = shared_dir()  # this process's: its name carries namespace and pid
    namespace = os.path.basename(mine)[len(SHARED_PREFIX):].split("-")[0]
    try:
        assert os.path.basename(mine).startswith(f"{SHARED_PREFIX}{namespace}-{os.getpid()}-")
        names = {"dead": f"{SHARED_PREFIX}{namespace}-{gone}-abc", "live": f"{SHARED_PREFIX}"
                 f"{namespace}-{os.getpid()}-abc", "other": f"{SHARED_PREFIX}1-{gone}-abc",
                 "old": f"{SHARED_PREFIX}abc"}
        for name in names.values():
            (tmp_path / name).mkdir()
        assert sweep_orphans(str(tmp_path), namespace) == [str(tmp_path / names["dead"])]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            names[k] for k in ("live", "other", "old"))
    finally:
        shutil.rmtree(mine)
