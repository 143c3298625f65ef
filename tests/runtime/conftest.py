"""Shared fixtures of the runtime tests: executors built around the trivial EchoRunner."""

from __future__ import annotations

import pytest
from runtime_helpers import config

from diffrt.runtime.factory import make_executor


@pytest.fixture(scope="module")
def inproc():
    ex = make_executor("inproc", config(tag="inproc",
                                        max_pending_output_bytes=64 << 20))
    yield ex
    ex.shutdown()
