"""Engine test fixtures: engines on the in-process executor around the toy
pipeline (instant, model-free), shared per module.

Every test starts and ends with all toy gates open, the call log empty and the
shared engines idle and healthy (``settled``), so no test depends on what ran
before it: the order of the tests does not matter.
"""

from __future__ import annotations

import pytest
from engine_helpers import engine_threads, settle_shared_engines, shared_engine, toy_engine
from waiting import wait_until


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny clips run in this process on one torch thread (as the engine's
    CPU workers run): on a shared 2-core machine two threads made them ten
    times slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def req_engine1():
    with shared_engine(toy_engine(max_num_seqs=1)) as e:
        yield e


@pytest.fixture(scope="module")
def req_engine4():
    with shared_engine(toy_engine(max_num_seqs=4)) as e:
        yield e


@pytest.fixture(scope="module")
def step_engine1():
    with shared_engine(toy_engine(max_num_seqs=1, step_execution=True)) as e:
        yield e


@pytest.fixture(scope="module")
def step_engine4():
    """One step per worker call: these tests pin down where requests join and
    leave (multi-step ticks have tests of their own)."""
    with shared_engine(toy_engine(max_num_seqs=4, step_execution=True,
                                  max_steps_per_tick=1)) as e:
        yield e


@pytest.fixture(autouse=True)
def settled():
    """Check (and restore) the shared state before each test; check it again
    after, so a test that leaves a request running, an engine broken or a thread
    of its own engine still working (e.g. a forward abandoned at shutdown) is the
    one reported."""
    settle_shared_engines()
    threads = engine_threads()
    yield
    settle_shared_engines()
    wait_until(lambda: engine_threads() <= threads,
               message=lambda: f"left running: {sorted(t.name for t in engine_threads() - threads)}")
