"""Session-wide set-up shared by every test folder.

The embedded models are written on first use into ``$DIFFRT_CACHE_DIR``; the
tests use a cache of their own (inherited by every worker and console script
they start), so they neither read nor fill the developer's cache. Each test
gets a step-cost store of its own (``$DIFFRT_STEP_COST_DIR``): an engine
started in one test is not priced by the calibration another test's engine
persisted (the engine's own store would otherwise carry it across tests).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_CACHE: str | None = None


def pytest_configure(config):
    global _CACHE
    _CACHE = tempfile.mkdtemp(prefix="diffrt-test-cache-")
    os.environ["DIFFRT_CACHE_DIR"] = _CACHE


@pytest.fixture(autouse=True)
def step_cost_store(request, monkeypatch):
    """A fresh, empty step-cost store for each test (see the module)."""
    assert _CACHE is not None
    folder = os.path.join(_CACHE, "step-cost-stores", request.node.nodeid.replace("/", "_"))
    monkeypatch.setenv("DIFFRT_STEP_COST_DIR", folder)
    return folder


def pytest_unconfigure(config):
    if _CACHE:
        shutil.rmtree(_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def flux_step_engine():
    """tiny-flux in step mode on the in-process executor, shared by the tests
    of every folder that only submit requests to it (each measures what it
    checks as a difference, or uses prompts of its own). Sizes share steps
    whenever the key allows (``share_steps="always"``), as these tests assume;
    the cost model's decision is ``test_share_steps``'s."""
    from diffrt.engine import DiffusionEngine, EngineConfig

    with DiffusionEngine.make_engine(EngineConfig(
            model="tiny-flux", executor_backend="inproc", step_execution=True,
            max_num_seqs=4, share_steps="always")) as engine:
        yield engine
