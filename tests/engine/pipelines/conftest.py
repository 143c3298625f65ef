"""Shared, session-scoped tiny pipelines (built once: construction imports diffusers)."""

from __future__ import annotations

import pytest

from diffrt.engine.pipelines import load_pipeline

MODELS = ["tiny-flux", "tiny-sd3"]


@pytest.fixture(scope="session")
def pipelines() -> dict:
    return {name: load_pipeline(name) for name in MODELS}


@pytest.fixture(params=MODELS)
def pipe(request, pipelines):
    return pipelines[request.param]


@pytest.fixture(scope="session")
def qwen_folder(tmp_path_factory) -> str:
    """One tiny Qwen-Image folder for the session (its builder learns a
    tokenizer: seconds each time)."""
    from diffrt.engine.models.tiny.qwen_image import build_tiny_qwen_image_folder

    return str(build_tiny_qwen_image_folder(tmp_path_factory.mktemp("qwen") / "qwen", seed=0))


@pytest.fixture(scope="module")
def one_torch_thread():
    """A module's tiny clips on one torch thread (as the engine's CPU workers
    run): on a shared 2-core machine two threads made them ten times slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
