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
