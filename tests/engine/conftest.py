"""Engine test fixtures: engines on the in-process executor around the toy
pipeline (instant, model-free), shared per module."""

from __future__ import annotations

import pytest
from engine_helpers import toy_engine


@pytest.fixture(scope="module")
def req_engine1():
    with toy_engine(max_num_seqs=1) as e:
        yield e


@pytest.fixture(scope="module")
def req_engine4():
    with toy_engine(max_num_seqs=4) as e:
        yield e


@pytest.fixture(scope="module")
def step_engine1():
    with toy_engine(max_num_seqs=1, step_execution=True) as e:
        yield e


@pytest.fixture(scope="module")
def step_engine4():
    with toy_engine(max_num_seqs=4, step_execution=True) as e:
        yield e
