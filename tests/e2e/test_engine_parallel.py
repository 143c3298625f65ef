"""Parallelism through the whole engine, worker ranks on gloo over loopback:
CFG parallel splits guidance's branches (or a CFG-less batch's rows),
Ulysses / ring the image tokens, both combined over four ranks, the VAE
decode in bands; the images equal one rank's (within 1/255: the same
arithmetic in another order). A rank killed mid-request fails it and the
engine leaves nothing behind."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from leaks import alive, fails_when_a_rank_dies
from waiting import wait_until

from diffrt.engine import (
    DiffusionEngine,
    DiffusionRequest,
    EngineConfig,
    SamplingParams,
)

LOOPBACK = {"worker_env": {"GLOO_SOCKET_IFNAME": "lo"}}


def requests(tag: str, *, cfg: bool = True, model: str = "tiny-sd3") -> list[DiffusionRequest]:
    """Two alike requests (a request batch of two), one with another step
    count (it leaves a step batch apart) and one whose 9 image tokens (48x48)
    split over no even number of ranks (it runs whole on each; its 6 latent
    rows make uneven VAE bands); with
    ``cfg`` they run classifier-free guidance (SD3: guidance_scale > 1;
    Flux: true CFG)."""
    scale = {"guidance_scale": 5.0 if cfg else 1.0}
    if model == "tiny-flux":
        scale = {"true_cfg_scale": 4.0 if cfg else 1.0}
    return [DiffusionRequest(prompt=f"a lighthouse {i}", request_id=f"{tag}-{i}",
                             negative_prompt="blurry" if cfg else None,
                             sampling_params=SamplingParams(height=size, width=size,
                                                            num_inference_steps=s, seed=i,
                                                            **scale))
            for i, s, size in ((1, 2, 64), (2, 2, 64), (3, 3, 64), (4, 2, 48))]


def pixels(outs) -> list[np.ndarray]:
    assert all(o.ok for o in outs), [o.error for o in outs]
    return [np.asarray(o.images[0]).astype(np.int16) for o in outs]


def assert_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert np.abs(a - b).max() <= 1


@pytest.fixture(scope="module")
def one_rank():
    """Reference images from one rank (in-process), per model and CFG or not."""
    refs = {}
    for model in ("tiny-sd3", "tiny-flux"):
        with DiffusionEngine.make_engine(EngineConfig(model=model, executor_backend="inproc",
                                                      max_num_seqs=4)) as engine:
            for cfg in (True, False):
                refs[model, cfg] = pixels(engine.generate(
                    requests("ref", cfg=cfg, model=model), timeout=120))
    return refs


def on_ranks(batches: list[list[DiffusionRequest]], **config) -> list[list[np.ndarray]]:
    """Each batch, in turn, through one engine of several worker ranks."""
    with DiffusionEngine.make_engine(EngineConfig(max_num_seqs=4, **LOOPBACK,
                                                  **config)) as engine:
        return [pixels(engine.generate(batch, timeout=120)) for batch in batches]


@pytest.mark.parametrize("step", [False, True], ids=["request", "step"])
def test_cfg_parallel_matches_one_rank_batched(step, one_rank):
    """Two ranks: a CFG batch runs a branch on each; a CFG-less batch shares
    its rows out. Request mode also decodes in bands (vae_parallel)."""
    with_cfg, without = on_ranks([requests("cfg"), requests("plain", cfg=False)],
                                 model="tiny-sd3", cfg_parallel_size=2, step_execution=step,
                                 vae_parallel=not step)
    assert_close(with_cfg, one_rank["tiny-sd3", True])
    assert_close(without, one_rank["tiny-sd3", False])


def test_cfg_parallel_shares_out_a_padded_mixed_step(one_rank):
    """Two ranks, Flux, rows of two sizes (64 and 48 px) padded into one call:
    a CFG batch runs a branch on each rank; a CFG-less batch shares its rows
    out, each rank's share as long as its own longest row."""
    with_cfg, without = on_ranks(
        [requests("mixcfg", model="tiny-flux"), requests("mix", model="tiny-flux", cfg=False)],
        model="tiny-flux", cfg_parallel_size=2, step_execution=True, mixed_rows="padded", share_steps="always")
    assert_close(with_cfg, one_rank["tiny-flux", True])
    assert_close(without, one_rank["tiny-flux", False])


@pytest.mark.parametrize("model,method,step", [
    ("tiny-flux", "ulysses_degree", False), ("tiny-flux", "ulysses_degree", True),
    ("tiny-flux", "ring_degree", True), ("tiny-sd3", "ulysses_degree", True),
    ("tiny-sd3", "ring_degree", False)])
def test_sequence_parallel_matches_one_rank_batched(model, method, step, one_rank):
    """The image tokens split over two ranks (Ulysses, ring), Flux and SD3;
    SD3's ring under torch.compile (the exchanges run eagerly)."""
    compiled = {"compile": True, "compile_backend": "aot_eager"} if model == "tiny-sd3" \
        and method == "ring_degree" else {}
    [got] = on_ranks([requests("sp", model=model)], model=model, step_execution=step,
                     **{method: 2}, **compiled)
    assert_close(got, one_rank[model, True])


def test_cfg_and_ulysses_on_four_ranks_with_parallel_decode(one_rank):
    """CFG 2 × Ulysses 2: each CFG branch's image tokens split over two ranks,
    the decode in four bands; Flux with true CFG, then without (rows shared)."""
    with_cfg, without = on_ranks(
        [requests("usp", model="tiny-flux"), requests("usp-plain", model="tiny-flux", cfg=False)],
        model="tiny-flux", cfg_parallel_size=2, ulysses_degree=2, vae_parallel=True,
        step_execution=True)
    assert_close(with_cfg, one_rank["tiny-flux", True])
    assert_close(without, one_rank["tiny-flux", False])


def test_int8_weights_split_over_cfg_ranks_as_on_one_rank():
    """Each rank converts its own copy of the weights (quantization="int8"):
    CFG parallel over two ranks draws the int8 images of one rank."""
    batch = requests("int8", model="tiny-flux")
    with DiffusionEngine.make_engine(EngineConfig(
            model="tiny-flux", executor_backend="inproc", max_num_seqs=4,
            quantization="int8")) as engine:
        want = pixels(engine.generate(batch, timeout=120))
    [got] = on_ranks([batch], model="tiny-flux", executor_backend="mp", cfg_parallel_size=2,
                     step_execution=True, quantization="int8")
    assert_close(got, want)


def test_a_rank_killed_mid_request_fails_it_and_leaves_nothing_behind():
    """The second rank of a Ulysses pair dies while a request runs: the
    request fails promptly (its peer would wait in a collective: the engine
    kills it), the engine reports itself dead, and close leaves no process."""
    engine = DiffusionEngine.make_engine(EngineConfig(  # no load-dependent cost limit
        model="tiny-flux", ulysses_degree=2, max_request_seconds=None, **LOOPBACK))
    pids = list(engine.executor.worker_pids)
    try:
        fails_when_a_rank_dies(engine, lambda: os.kill(pids[1], signal.SIGKILL), wait_until,
                               requests("after")[0])
    finally:
        engine.close()
    assert wait_until(lambda: not any(alive(p) for p in pids))


def test_sd35_style_folder_with_dual_attention_splits_exactly(tmp_path_factory):
    """A complete SD3.5-style folder (RMS q/k norms, a block with a second,
    image-only attention): Ulysses 2 and the banded decode give one rank's
    images."""
    from diffrt.engine.models.tiny.sd3 import build_tiny_sd3_folder

    folder = str(build_tiny_sd3_folder(tmp_path_factory.mktemp("sd35") / "sd35", seed=5,
                                       sd35=True))
    batch = requests("sd35", model=folder)
    with DiffusionEngine.make_engine(EngineConfig(model=folder, executor_backend="inproc",
                                                  max_num_seqs=2)) as engine:
        want = pixels(engine.generate(batch, timeout=120))
    [got] = on_ranks([batch], model=folder, ulysses_degree=2, vae_parallel=True)
    assert_close(got, want)


FAULTS = {"worker_env": {**LOOPBACK["worker_env"], "PYTHONPATH": os.path.dirname(__file__)}}


def test_a_failure_on_one_rank_only_ends_that_rank_not_in_a_hang():
    """Step mode, Ulysses 2, faults injected on rank 1 only (tests/e2e/
    rank_faults.py): a failed admission there drops the request on every rank
    (the others go on, the engine stays healthy); a failed shared step ends
    rank 1, the request fails with rank 1's error, the engine is down (its
    other rank's collectives broke), and nothing hangs or stays behind."""
    engine = DiffusionEngine.make_engine(EngineConfig(
        model="tiny-flux", ulysses_degree=2, step_execution=True, max_num_seqs=2,
        plugin_modules=["rank_faults"], **FAULTS))
    pids = list(engine.executor.worker_pids)
    try:
        def req(prompt: str) -> DiffusionRequest:
            return DiffusionRequest(prompt=prompt, sampling_params=SamplingParams(
                height=64, width=64, num_inference_steps=2, seed=0))

        bad, good = engine.generate([req("fault-admit:rank1"), req("a fox")], timeout=60)
        assert not bad.ok and "another rank" in bad.error and good.ok
        assert engine.is_healthy()
        # the fault, not the (generous) timeout, ends it: the error names both
        [out] = engine.generate([req("fault-step:rank1")], timeout=300)
        assert not out.ok and "rank 1" in out.error and "injected fault" in out.error, out.error
        assert wait_until(lambda: not engine.is_healthy())
    finally:
        engine.close()
    assert wait_until(lambda: not any(alive(p) for p in pids))


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    from diffrt.engine.models.tiny.qwen_image import build_tiny_qwen_image_folder

    return str(build_tiny_qwen_image_folder(tmp_path_factory.mktemp("qwen") / "qwen", seed=0))


@pytest.mark.parametrize("method", ["cfg_parallel_size", "ulysses_degree"])
def test_qwen_image_parallel_matches_one_rank(method, qwen_folder):
    """Qwen-Image, CFG parallel (its norm rescaling after the gather) and
    Ulysses (its rotary rows split, prompts of different lengths padded and
    masked in one batch), step mode: one rank's images."""
    batch = [DiffusionRequest(prompt, request_id=f"qwen-{i}", negative_prompt=negative,
                              sampling_params=SamplingParams(height=64, width=64, seed=i,
                                                             num_inference_steps=2,
                                                             true_cfg_scale=4.0))
             for i, (prompt, negative) in enumerate([("a red fox in the snow", "blurry"),
                                                     ("a cat", "low quality, dark and noisy"),
                                                     ("an old castle on a hill", None)])]
    with DiffusionEngine.make_engine(EngineConfig(model=qwen_folder, executor_backend="inproc",
                                                  max_num_seqs=4, step_execution=True)) as one:
        want = pixels(one.generate(batch, timeout=120))
    [got] = on_ranks([batch], model=qwen_folder, step_execution=True, **{method: 2})
    assert_close(got, want)
